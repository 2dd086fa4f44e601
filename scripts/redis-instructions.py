#!/usr/bin/env python3
"""Instructions of redis-server per EVALSHA of the token-bucket scripts, under callgrind.

Starts `redis-server` under `valgrind --tool=callgrind` once per case, loads the script,
runs 2,000 calls over 1,000 keys as a warm-up, zeroes the counters, runs N pipelined calls
(64 at a time on one connection, keys taken in turn among 1,000) and divides the
instructions of the whole server (parsing, script, reply) by N. The counts are
deterministic to within about 2% from one run to the next.

    scripts/redis-instructions.py [SCRIPT_DIR]
    scripts/redis-instructions.py --commands
    scripts/redis-instructions.py --generations [SCRIPT_DIR]

`--commands` counts scripts that make nothing but one read and one kind of write (or
nothing at all), over the same keys: what each command costs inside a script call.

`--generations` measures a layout the crate does not use, by its limit: a batch's token
buckets kept as fields of two hashes per rule, one per generation of time (`HMGET` of the
batch's fields in each, one `HSET` of all it writes and a `PEXPIRE`, so that a hash
outlives its generation by one more and expires whole; not the crate's layout), against a
key per bucket (a `GET` and a `PSETEX` per request). First the commands alone, then the
rule's own batch script as built against the same decision reading and writing the
hashes; 16 requests per call, over 16,000 buckets.

A rule's own one-band script (`src/rule_script.rs` in `fluxgate-redis`: the one-band
script with the rule's numbers written in, the cost its only argument) is counted after
the one-band script, then again over 10 keys in turn instead of 1,000, so that each key
comes back within its instant's second and its write keeps its expiry (`SET … KEEPTTL`;
among 1,000 keys, at callgrind's pace, a key comes back seconds later). The rule's own
batch script likewise, its 16 keys the same in every call.

The batch script (`batch.lua`) is counted with 16 one-band requests per call, divided by
the requests as well as by the calls; then a rule's own batch script (`src/rule_script.rs`:
the one-band script, its numbers written in, as a function of a key and a cost, then
`rule_batch.lua`) with the same 16 requests, one cost for all.

SCRIPT_DIR holds the joined scripts (`one_token_bucket.lua`, `token_buckets.lua`,
`batch.lua`, `rule_batch.lua`): the
build script's `OUT_DIR` of `fluxgate-redis`, by default the newest under
`$CARGO_TARGET_DIR` (or `target`). The peer's script (`tower-rate-limit-fred`) is counted
too when it is in Cargo's registry. Needs `valgrind` (with `callgrind_control`) and
`redis-server`.
"""
import glob, os, socket, subprocess, sys, tempfile, time

PORT = int(os.environ.get('PORT', '7890'))


def enc(*args):
    out = b'*%d\r\n' % len(args)
    for a in args:
        a = a if isinstance(a, bytes) else str(a).encode()
        out += b'$%d\r\n%s\r\n' % (len(a), a)
    return out


class Conn:
    def __init__(self):
        self.sock = socket.create_connection(('127.0.0.1', PORT))
        self.buf = b''

    def line(self):
        while b'\r\n' not in self.buf:
            self.buf += self.sock.recv(1 << 20)
        line, self.buf = self.buf.split(b'\r\n', 1)
        return line

    def read(self):
        line = self.line()
        kind = line[:1]
        if kind in b'+:':
            return line[1:]
        if kind == b'-':
            raise RuntimeError(line.decode())
        if kind == b'$':
            n = int(line[1:])
            if n < 0:
                return None
            while len(self.buf) < n + 2:
                self.buf += self.sock.recv(1 << 20)
            value, self.buf = self.buf[:n], self.buf[n + 2:]
            return value
        return [self.read() for _ in range(int(line[1:]))]

    def call(self, *args):
        self.sock.sendall(enc(*args))
        return self.read()

    def pipelined(self, commands):
        for i in range(0, len(commands), 64):
            batch = commands[i:i + 64]
            self.sock.sendall(b''.join(batch))
            for _ in batch:
                self.read()


def count(name, script, keys, args, n, per=1, turn=1000):
    out = tempfile.mkdtemp(prefix='redis-instructions-')
    dump = os.path.join(out, 'callgrind.out')
    server = subprocess.Popen(
        ['valgrind', '--tool=callgrind', f'--callgrind-out-file={dump}', 'redis-server',
         '--port', str(PORT), '--save', '', '--appendonly', 'no'],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(300):
            try:
                conn = Conn()
                conn.call('PING')
                break
            except OSError:
                time.sleep(0.2)
        sha = conn.call('SCRIPT', 'LOAD', open(script).read()).decode()

        def command(i):
            # `{i}` in a key or an argument: the call's place among `turn` (1,000) in turn.
            return enc('EVALSHA', sha, len(keys), *[k.format(i=i % turn) for k in keys],
                       *[a.format(i=i % turn) for a in args])

        conn.pipelined([command(i) for i in range(2000)])
        commands = [command(i) for i in range(n)]
        subprocess.run(['callgrind_control', '-z', str(server.pid)], stdout=subprocess.DEVNULL, check=True)
        conn.pipelined(commands)
        subprocess.run(['callgrind_control', '-d', str(server.pid)], stdout=subprocess.DEVNULL, check=True)
        time.sleep(0.5)
        total = None
        for path in sorted(glob.glob(dump + '*'), key=os.path.getmtime):
            for line in open(path, errors='replace'):
                if line.startswith(('totals:', 'summary:')):
                    total = int(line.split()[1])
                    break
    finally:
        server.terminate()
        server.wait()
    print(f'{name:<44} {total / n:>10,.0f}', flush=True)
    if per > 1:
        print(f'{"  the same per request":<44} {total / n / per:>10,.0f}', flush=True)


def rule(r, bands):
    """One rule of `bands` bands of 10,000,000 per hour, as the crate sends it."""
    layout = ','.join(f'b{b}:10000000/1h' for b in range(bands)) + '|'
    # Flags: bands × 8 (+ 4 when the request may wait, 2 when scaled, 1 in shadow mode).
    return [format(bands * 8, 'x'), layout, '3601001'] + ['d693a400', '168'] * bands


# The lines of one_token_bucket.lua that read a rule's arguments, which a rule's own script
# replaces with its numbers (as `src/rule_script.rs` in fluxgate-redis does).
ARGUMENTS = ("local key, layout, offset = KEYS[1], ARGV[1], nil\n"
             "local cap, cost, ttl, scale, wait = tonumber(ARGV[2], 16), tonumber(ARGV[3], 16), "
             "ARGV[4], ARGV[5], ARGV[6]\n"
             "scale = scale and tonumber(scale, 16) or 1\n")


def rule_script(one, layout, cap, ttl):
    """A rule's own one-band script: its layout, capacity (hex) and expiry written in, the
    comment lines left out; the cost its only argument."""
    before, after = one.split(ARGUMENTS)
    own = (f"local key, layout, offset = KEYS[1], '{layout}', '{len(layout)}'\n"
           f"local cap, cost, ttl, scale, wait = 0x{cap}, tonumber(ARGV[1], 16), '{ttl}', 0x1, nil\n")
    lines = (before + own + after).splitlines()
    return ''.join(l + '\n' for l in lines if l.strip() and not l.lstrip().startswith('--'))


# The lines of one_token_bucket.lua that read the clock, which a batch reads once, its
# reply, whose `now` a batch's reply holds once, and its read of the key, which a batch
# makes with its other keys.
TIME = "local time = redis.call('TIME')\nlocal now = time[1] * 1000000 + time[2]\n"
REPLY = "return {now, debt}\n"
READ = "local v = redis.call('GET', key)\n"
READ_IN_BATCH = "local v = stored\nif not v then\n  v = redis.call('GET', key)\nend\n"


def rule_batch_script(one, loop, layout, cap, ttl):
    """A rule's own batch script, as `src/rule_script.rs` writes it: the clock read once,
    the one-band script as a function of a key, a cost and the key's value read with the
    batch's keys, with the rule's numbers written in, then `rule_batch.lua`; the comment
    lines left out. Its `ARGV`: how many keys repeat (and their places), then the costs."""
    before, after = one.split(ARGUMENTS)
    after = (after.replace(TIME, 'local now = batch_now\n', 1).replace(READ, READ_IN_BATCH, 1)
             .replace(REPLY, 'return debt\n', 1))
    text = ("local batch_time = redis.call('TIME')\n"
            "local batch_now = batch_time[1] * 1000000 + batch_time[2]\n"
            "local decide = function(key, cost, stored)\n" + before +
            f"local layout, offset = '{layout}', '{len(layout)}'\n"
            f"local cap, ttl, scale, wait = 0x{cap}, '{ttl}', 0x1, nil\n" + after + "end\n" + loop)
    return ''.join(l + '\n' for l in text.splitlines() if l.strip() and not l.lstrip().startswith('--'))


# What each command a token-bucket script makes costs inside a script call: scripts that
# make nothing but it, over the same keys (`--commands`).
COMMANDS = [
    ('nothing (the call alone)', 'return 1'),
    ('GET', "redis.call('GET', KEYS[1]) return 1"),
    ('GET, PTTL', "redis.call('GET', KEYS[1]) redis.call('PTTL', KEYS[1]) return 1"),
    ('GET, PSETEX', "redis.call('GET', KEYS[1]) redis.call('PSETEX', KEYS[1], ARGV[1], ARGV[3]) return 1"),
    ('GET, SET PX', "redis.call('GET', KEYS[1]) redis.call('SET', KEYS[1], ARGV[3], 'PX', ARGV[1]) return 1"),
    ('GET, SET PXAT', "redis.call('GET', KEYS[1]) redis.call('SET', KEYS[1], ARGV[3], 'PXAT', ARGV[2]) return 1"),
    ('GET, SET KEEPTTL', "redis.call('GET', KEYS[1]) redis.call('SET', KEYS[1], ARGV[3], 'KEEPTTL') return 1"),
]


def commands():
    key = 'fluxgate:{{default:rule0:ip=10.0.{i}.1}}'
    at = str(int(time.time() * 1000) + 3601001)
    print(f'{"script call":<44} {"instr/call":>10}')
    with tempfile.TemporaryDirectory() as d:
        for name, body in COMMANDS:
            script = os.path.join(d, 'script.lua')
            with open(script, 'w') as f:
                f.write(body)
            count(name, script, [key], ['3601001', at, 'b0:10000000/1h|18c3a4f2e1b4a'], 10000)


# A batch's buckets as the fields of a generation's hash (`--generations`): the commands
# alone, a key per bucket against the hashes.
GENERATION_COMMANDS = [
    ('a key per bucket: GET, PSETEX of each', False,
     "redis.call('TIME') for i = 1, #KEYS do redis.call('GET', KEYS[i]) "
     "redis.call('PSETEX', KEYS[i], 3601001, 'v') end return 1"),
    ('two generations: HMGET of all in each, one HSET', True,
     "redis.call('TIME') redis.call('HMGET', KEYS[1], unpack(ARGV)) redis.call('HMGET', KEYS[2], unpack(ARGV)) "
     "local kv = {} for i = 1, #ARGV do kv[2 * i - 1] = ARGV[i] kv[2 * i] = 'v' end "
     "redis.call('HSET', KEYS[1], unpack(kv)) redis.call('PEXPIRE', KEYS[1], 7202002) return 1"),
]


# The loop of a rule's batch script reading its buckets from two generation hashes (KEYS[1]
# this one, KEYS[2] the one before; the requests' key values after the cost in ARGV) and
# writing them with one HSET into this one, in place of `rule_batch.lua`.
GENERATION_LOOP = """local reply, cost = {batch_now}, tonumber(ARGV[1], 16)
local fields = {}
for i = 2, #ARGV do fields[i - 1] = ARGV[i] end
local a, b = redis.call('HMGET', KEYS[1], unpack(fields)), redis.call('HMGET', KEYS[2], unpack(fields))
for i = 1, #fields do local v = a[i] or b[i] if v then got[fields[i]] = v end end
for i = 1, #fields do
  local ok, r = pcall(decide, fields[i], cost)
  if ok then reply[i + 1] = r else reply[i + 1] = type(r) == 'table' and tostring(r.err) or tostring(r) end
end
if #put > 0 then redis.call('HSET', KEYS[1], unpack(put)) redis.call('PEXPIRE', KEYS[1], 7202002) end
return reply
"""


def generation_script(one):
    """The rule's own batch script's decision reading and writing generation hashes."""
    built = rule_batch_script(one, GENERATION_LOOP, 'b0:10000000/1h|', 'd693a400', '3601001')
    for line in ("redis.call('GET', key)", "redis.call('PSETEX', key, ttl, value)"):
        if line not in built:
            sys.exit(f'the rule batch script changed; not found: {line!r}')
    gen = built.replace("redis.call('GET', key)", "got[key]")
    # A key written twice in a batch reads its first write.
    gen = gen.replace("redis.call('PSETEX', key, ttl, value)",
                      "got[key] = value put[#put + 1] = key put[#put + 1] = value")
    return "local got, put = {}, {}\n" + gen


def generations(scripts):
    requests = 16
    fields = [f'ip={j}.10.0.{{i}}.1' for j in range(requests)]
    keys = ['fluxgate:{{{{default:per-ip:{}}}}}'.format(f) for f in fields]
    hashes = ['fluxgate:{{default:per-ip}}:g1', 'fluxgate:{{default:per-ip}}:g0']
    print(f'{"call, 16 requests":<44} {"instr/call":>10}')
    with tempfile.TemporaryDirectory() as d:
        script = os.path.join(d, 'script.lua')
        for name, hashed, body in GENERATION_COMMANDS:
            with open(script, 'w') as f:
                f.write(body)
            count(name, script, hashes if hashed else keys, fields if hashed else [], 20000 // requests, requests)
        one = open(os.path.join(scripts, 'one_token_bucket.lua')).read()
        built = rule_batch_script(one, open(os.path.join(scripts, 'rule_batch.lua')).read(),
                                  'b0:10000000/1h|', 'd693a400', '3601001')
        with open(script, 'w') as f:
            f.write(built)
        count("the rule's own batch script, a key per bucket", script, keys, ['0', '168'], 20000 // requests, requests)
        with open(script, 'w') as f:
            f.write(generation_script(one))
        count('the same on two generation hashes', script, hashes, ['168'] + fields, 20000 // requests, requests)


def built_scripts(args):
    """SCRIPT_DIR, or the newest built one."""
    if args:
        return args[0]
    target = os.environ.get('CARGO_TARGET_DIR', 'target')
    dirs = glob.glob(os.path.join(target, '*', 'build', 'fluxgate-redis-*', 'out'))
    dirs = [d for d in dirs if os.path.exists(os.path.join(d, 'one_token_bucket.lua'))]
    if not dirs:
        sys.exit('no built scripts: cargo build -p fluxgate-redis, or name their directory')
    return max(dirs, key=lambda d: os.path.getmtime(os.path.join(d, 'token_buckets.lua')))


def main():
    if sys.argv[1:] == ['--commands']:
        return commands()
    if sys.argv[1:2] == ['--generations']:
        return generations(built_scripts(sys.argv[2:]))
    scripts = built_scripts(sys.argv[1:])
    one = os.path.join(scripts, 'one_token_bucket.lua')
    many = os.path.join(scripts, 'token_buckets.lua')
    # Formatted twice: with the rule, then with the client.
    key = 'fluxgate:{{{{default:rule{r}:ip=10.0.{{i}}.1}}}}'
    print(f'{"call":<44} {"instr/call":>10}')
    count('one band (one_token_bucket.lua)', one, [key.format(r=0)],
          ['b0:10000000/1h|', 'd693a400', '168', '3601001'], 20000)
    with tempfile.TemporaryDirectory() as d:
        own = os.path.join(d, 'rule.lua')
        with open(own, 'w') as f:
            f.write(rule_script(open(one).read(), 'b0:10000000/1h|', 'd693a400', '3601001'))
        count("one band (the rule's own script)", own, [key.format(r=0)], ['168'], 20000)
        # Ten keys in turn: each decided again well within its instant's second, so that its
        # write keeps its expiry (`SET … KEEPTTL`), as a key decided more than once a second
        # is under load. Among 1,000 keys, at callgrind's pace, a key comes back seconds
        # later and its write sets the expiry again.
        count("  the same, each key again within its second", own, [key.format(r=0)], ['168'], 20000,
              turn=10)
    for rules, bands, n in [(1, 2, 20000), (1, 4, 20000), (1, 8, 10000), (3, 2, 10000)]:
        args = [a for r in range(rules) for a in rule(r, bands)]
        count(f'{rules} rule(s) x {bands} bands (token_buckets.lua)', many,
              [key.format(r=r) for r in range(rules)], args, n)
    batch = os.path.join(scripts, 'batch.lua')
    if os.path.exists(batch):
        # 16 one-band requests of one rule: the rule's arguments once, then a header per
        # request (script 1, one key, the first list: 5), as the crate sends them.
        requests = 16
        keys = [key.format(r=0).replace('ip=', f'ip={j}.') for j in range(requests)]
        args = ['1', '4', 'b0:10000000/1h|', 'd693a400', '168', '3601001'] + ['5'] * requests
        count(f'batch of {requests} one-band requests (batch.lua)', batch, keys, args, 20000 // requests, requests)
        loop = os.path.join(scripts, 'rule_batch.lua')
        if os.path.exists(loop):
            with tempfile.TemporaryDirectory() as d:
                own = os.path.join(d, 'rule_batch.lua')
                with open(own, 'w') as f:
                    f.write(rule_batch_script(open(one).read(), open(loop).read(),
                                              'b0:10000000/1h|', 'd693a400', '3601001'))
                # No key repeated, the cost once, every request's.
                count(f"batch of {requests} (the rule's own batch script)", own, keys, ['0', '168'],
                      20000 // requests, requests)
                count("  the same, each key again within its second", own, keys, ['0', '168'],
                      20000 // requests, requests, turn=1)
    home = os.environ.get('CARGO_HOME', os.path.expanduser('~/.cargo'))
    peer = sorted(glob.glob(os.path.join(home, 'registry/src/*/tower-rate-limit-fred-*/scripts/rate_limit.lua')))
    if peer:
        count('tower-rate-limit-fred (one band)', peer[-1], ['10.0.{i}.1'], ['65535', '1'], 20000)


if __name__ == '__main__':
    main()
