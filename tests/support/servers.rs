//! Real `redis-server` processes for the tests and benchmarks, each started on a free
//! loopback port in a temporary directory and stopped when dropped: a standalone server, a
//! 3-primary cluster, a primary with a replica and three sentinels. No test skips when
//! `redis-server` is missing: it fails and says how to install it.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

/// A running `redis-server`.
pub(crate) struct RedisServer {
    child: Child,
    port: u16,
    dir: PathBuf,
    /// How far its wall clock lies ahead of the machine's, in ms (behind when negative).
    clock_offset_ms: i64,
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

/// A shared library that moves the wall clock (`clock_gettime(CLOCK_REALTIME)`,
/// `gettimeofday`, `time`) of the process it is preloaded into by `FLUXGATE_CLOCK_OFFSET_MS`
/// milliseconds, leaving the monotonic clocks alone: a `redis-server` whose `TIME`, and so
/// every instant of the scripts and every key's expiry, lies ahead of the machine's clock
/// or behind it, as a replica's may. It reads the clock with the system call itself, so
/// that no allocator's call of the clock during start-up comes back into it. Compiled once
/// per test process with `cc`, the C compiler Rust links with on Linux.
fn clock_shim() -> &'static Path {
    const SOURCE: &str = r#"
#define _GNU_SOURCE
#include <stdlib.h>
#include <sys/syscall.h>
#include <sys/time.h>
#include <time.h>
#include <unistd.h>

static long long offset_ns;

__attribute__((constructor)) static void init(void) {
    const char *s = getenv("FLUXGATE_CLOCK_OFFSET_MS");
    offset_ns = s ? atoll(s) * 1000000LL : 0;
}

int clock_gettime(clockid_t id, struct timespec *ts) {
    long r = syscall(SYS_clock_gettime, id, ts);
    if (r == 0 && (id == CLOCK_REALTIME || id == CLOCK_REALTIME_COARSE)) {
        long long ns = (long long)ts->tv_sec * 1000000000LL + ts->tv_nsec + offset_ns;
        ts->tv_sec = ns / 1000000000LL;
        ts->tv_nsec = ns % 1000000000LL;
    }
    return (int)r;
}

int gettimeofday(struct timeval *tv, void *tz) {
    struct timespec ts;
    (void)tz;
    clock_gettime(CLOCK_REALTIME, &ts);
    if (tv) {
        tv->tv_sec = ts.tv_sec;
        tv->tv_usec = ts.tv_nsec / 1000;
    }
    return 0;
}

time_t time(time_t *t) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    if (t) {
        *t = ts.tv_sec;
    }
    return ts.tv_sec;
}
"#;
    static SHIM: OnceLock<PathBuf> = OnceLock::new();
    SHIM.get_or_init(|| {
        let dir = std::env::temp_dir().join(format!("fluxgate-clock-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let (source, library) = (dir.join("clock.c"), dir.join("clock.so"));
        std::fs::write(&source, SOURCE).unwrap();
        let ok = Command::new("cc")
            .args(["-shared", "-fPIC", "-O2", "-o"])
            .arg(&library)
            .arg(&source)
            .status()
            .expect("cc (the C compiler Rust links with) runs")
            .success();
        assert!(ok, "cc compiles the clock shim");
        library
    })
}

/// Starts `redis-server` on `port` with its files in `dir`, its wall clock `clock_offset_ms`
/// ahead of the machine's (see [`clock_shim`]).
fn spawn(port: u16, dir: &std::path::Path, extra: &[&str], clock_offset_ms: i64) -> Child {
    let mut command = Command::new("redis-server");
    if clock_offset_ms != 0 {
        command
            .env("LD_PRELOAD", clock_shim())
            .env("FLUXGATE_CLOCK_OFFSET_MS", clock_offset_ms.to_string());
    }
    command
        .args([
            "--port",
            &port.to_string(),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
        ])
        .args(extra)
        .arg("--dir")
        .arg(dir)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap_or_else(|e| {
            panic!(
                "cannot start redis-server ({e}): the Redis tests need it; ./scripts/test.sh installs it \
                 (Debian: apt-get install redis-server redis-tools redis-sentinel)"
            )
        })
}

fn ping(port: u16) -> bool {
    let Ok(mut s) = TcpStream::connect(("127.0.0.1", port)) else {
        return false;
    };
    let _ = s.set_read_timeout(Some(Duration::from_millis(200)));
    let mut buf = [0u8; 7];
    s.write_all(b"PING\r\n").is_ok() && s.read_exact(&mut buf).is_ok() && &buf == b"+PONG\r\n"
}

impl RedisServer {
    /// Starts a standalone server.
    pub(crate) fn start() -> Self {
        Self::start_with(&[])
    }

    /// Starts a server with extra configuration arguments.
    pub(crate) fn start_with(extra: &[&str]) -> Self {
        Self::start_with_clock(extra, 0)
    }

    /// Starts a server with extra configuration arguments, its wall clock (its `TIME`, its
    /// keys' expiry) `clock_offset_ms` ahead of the machine's, or behind it when negative.
    pub(crate) fn start_with_clock(extra: &[&str], clock_offset_ms: i64) -> Self {
        static SEQ: AtomicUsize = AtomicUsize::new(0);
        for _ in 0..5 {
            let port = free_port();
            let dir = std::env::temp_dir().join(format!(
                "fluxgate-redis-{}-{}",
                std::process::id(),
                SEQ.fetch_add(1, Ordering::SeqCst)
            ));
            std::fs::create_dir_all(&dir).unwrap();
            let child = spawn(port, &dir, extra, clock_offset_ms);
            let mut server = Self {
                child,
                port,
                dir,
                clock_offset_ms,
            };
            let deadline = Instant::now() + Duration::from_secs(10);
            while Instant::now() < deadline {
                if ping(port) {
                    server.wait_out_first_second();
                    return server;
                }
                if let Ok(Some(_)) = server.child.try_wait() {
                    break; // the port was taken in between: try another
                }
                std::thread::sleep(Duration::from_millis(10));
            }
            server.stop();
        }
        panic!("redis-server did not start");
    }

    /// Waits until the server's clock has left the second it started in: the refund
    /// script gives nothing back of a decision made in that second, which may have come
    /// before the start (`lua/refund.lua`), and the tests that give back expect it back.
    fn wait_out_first_second(&self) {
        let deadline = Instant::now() + Duration::from_secs(5);
        while Instant::now() < deadline {
            let info = self.cli(&["INFO", "server"]);
            let uptime = info
                .lines()
                .find_map(|l| l.strip_prefix("uptime_in_seconds:"))
                .and_then(|v| v.trim().parse::<u64>().ok());
            if uptime.is_some_and(|u| u >= 1) {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// The port.
    pub(crate) fn port(&self) -> u16 {
        self.port
    }

    /// `redis://127.0.0.1:<port>`.
    pub(crate) fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    /// A field of `cmdstat_evalsha` in `INFO commandstats` (`calls`, `usec_per_call`…).
    pub(crate) fn evalsha_stat(&self, field: &str) -> f64 {
        self.cli(&["INFO", "commandstats"])
            .lines()
            .find(|l| l.starts_with("cmdstat_evalsha:"))
            .and_then(|l| l.split(&format!("{field}=")).nth(1))
            .and_then(|v| v.split(',').next())
            .map_or(0.0, |v| v.parse().expect("a number"))
    }

    /// The `SCRIPT LOAD` commands this server refused (its user may not load scripts).
    pub(crate) fn rejected_script_loads(&self) -> u64 {
        self.cli(&["INFO", "commandstats"])
            .lines()
            .find(|l| l.starts_with("cmdstat_script|load:"))
            .and_then(|l| l.split("rejected_calls=").nth(1))
            .and_then(|v| v.split(',').next())
            .map_or(0, |v| v.parse().expect("a number"))
    }

    /// A number of `INFO section`: the value of `field`.
    pub(crate) fn info_number(&self, section: &str, field: &str) -> u64 {
        let info = self.cli(&["INFO", section]);
        info.lines()
            .find_map(|line| line.strip_prefix(field)?.strip_prefix(':'))
            .unwrap_or_else(|| panic!("no {field} in INFO {section}"))
            .trim()
            .parse()
            .expect("a number")
    }

    /// The `EVALSHA` calls this server has run.
    pub(crate) fn evalsha_calls(&self) -> u64 {
        self.evalsha_stat("calls") as u64
    }

    /// The server's process id.
    pub(crate) fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Sends the server a signal (`-STOP`, `-CONT`).
    pub(crate) fn signal(&self, signal: &str) {
        let ok = Command::new("kill")
            .args([signal, &self.child.id().to_string()])
            .status()
            .expect("kill runs")
            .success();
        assert!(ok, "kill {signal}");
    }

    /// Kills the server (its data is gone, as after a crash).
    pub(crate) fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Starts the server again on the same port.
    pub(crate) fn restart(&mut self) {
        self.kill();
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            self.child = spawn(self.port, &self.dir, &[], self.clock_offset_ms);
            let started = Instant::now();
            while started.elapsed() < Duration::from_secs(2) {
                if ping(self.port) {
                    return;
                }
                if let Ok(Some(_)) = self.child.try_wait() {
                    break;
                }
                std::thread::sleep(Duration::from_millis(10));
            }
            assert!(
                Instant::now() < deadline,
                "redis-server did not restart on port {}",
                self.port
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Runs `redis-cli` against this server and returns its output.
    /// Its node id in its cluster (`CLUSTER MYID`).
    pub(crate) fn cluster_id(&self) -> String {
        self.cli(&["CLUSTER", "MYID"]).trim().to_owned()
    }

    pub(crate) fn cli(&self, args: &[&str]) -> String {
        let out = Command::new("redis-cli")
            .args(["-p", &self.port.to_string()])
            .args(args)
            .output()
            .expect("redis-cli (package redis-tools) runs");
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// The server's clock (`TIME`), in µs since the Unix epoch.
    pub(crate) fn time_us(&self) -> u64 {
        let out = self.cli(&["TIME"]);
        let mut parts = out
            .split_whitespace()
            .map(|p| p.parse::<u64>().expect("TIME's numbers"));
        let (secs, micros) = (parts.next().expect("seconds"), parts.next().expect("microseconds"));
        secs * 1_000_000 + micros
    }

    fn stop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        self.stop();
    }
}

/// A 3-primary Redis Cluster on free loopback ports, stopped when dropped.
pub(crate) struct RedisCluster {
    pub(crate) nodes: Vec<RedisServer>,
}

impl RedisCluster {
    pub(crate) fn start() -> Self {
        let nodes = (0..3)
            .map(|_| RedisServer::start_with(&["--cluster-enabled", "yes", "--cluster-node-timeout", "5000"]))
            .collect();
        // Within a minute: several tests start clusters at once on a busy machine.
        Self::create(nodes, 0, Duration::from_secs(60))
    }

    /// Three primaries, each with a replica that takes over 1 s after its primary stops
    /// answering (`cluster-node-timeout 1000`, whatever the replica's lag). Returns once
    /// every replica is in sync.
    pub(crate) fn start_with_replicas() -> Self {
        let nodes = (0..6)
            .map(|_| {
                RedisServer::start_with(&[
                    "--cluster-enabled",
                    "yes",
                    "--cluster-node-timeout",
                    "1000",
                    "--repl-diskless-sync-delay",
                    "0",
                    "--cluster-replica-validity-factor",
                    "0",
                ])
            })
            .collect();
        Self::create(nodes, 1, Duration::from_secs(30))
    }

    /// Makes a cluster of `nodes` with `replicas` replicas per primary (`redis-cli --cluster
    /// create`); returns once every node reports `cluster_state:ok` and every replica is in
    /// sync, within `within`.
    fn create(nodes: Vec<RedisServer>, replicas: usize, within: Duration) -> Self {
        let addrs: Vec<String> = nodes.iter().map(|n| format!("127.0.0.1:{}", n.port)).collect();
        let out = Command::new("redis-cli")
            .args(["--cluster", "create"])
            .args(&addrs)
            .args(["--cluster-replicas", &replicas.to_string(), "--cluster-yes"])
            .output()
            .expect("redis-cli --cluster create");
        assert!(
            out.status.success(),
            "cluster create failed: {}",
            String::from_utf8_lossy(&out.stdout)
        );
        let cluster = Self { nodes };
        let replica_count = cluster.nodes.len() * replicas / (replicas + 1);
        let deadline = Instant::now() + within;
        loop {
            let ok = cluster
                .nodes
                .iter()
                .all(|n| n.cli(&["CLUSTER", "INFO"]).contains("cluster_state:ok"));
            let synced = replica_count == 0
                || cluster
                    .nodes
                    .iter()
                    .filter(|n| n.cli(&["INFO", "replication"]).contains("master_link_status:up"))
                    .count()
                    == replica_count;
            if ok && synced {
                return cluster;
            }
            assert!(
                Instant::now() < deadline,
                "the cluster did not reach cluster_state:ok with its replicas in sync"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// The port of the primary serving `slot` as `node` sees the cluster, if it has one that
    /// is not failing.
    pub(crate) fn primary_of_slot_seen_by(node: &RedisServer, slot: u16) -> Option<u16> {
        node.cli(&["CLUSTER", "NODES"]).lines().find_map(|line| {
            let fields: Vec<&str> = line.split_whitespace().collect();
            let flags = fields.get(2)?;
            if !flags.contains("master") || flags.contains("fail") {
                return None;
            }
            let serves = fields.iter().skip(8).any(|range| {
                let (low, high) = range.split_once('-').unwrap_or((range, range));
                matches!((low.parse::<u16>(), high.parse::<u16>()), (Ok(l), Ok(h)) if (l..=h).contains(&slot))
            });
            let port = fields.get(1)?.split('@').next()?.rsplit(':').next()?.parse().ok()?;
            serves.then_some(port)
        })
    }

    /// The seed's convention: comma-separated nodes.
    pub(crate) fn url(&self) -> String {
        let nodes: Vec<String> = self.nodes.iter().map(|n| format!("127.0.0.1:{}", n.port)).collect();
        format!("redis://{}", nodes.join(","))
    }

    /// `EVALSHA` calls counted by every node.
    pub(crate) fn evalsha_calls(&self) -> u64 {
        self.nodes.iter().map(RedisServer::evalsha_calls).sum()
    }

    /// The node that serves a hash slot, from `CLUSTER NODES`.
    pub(crate) fn node_of_slot(&self, slot: u16) -> &RedisServer {
        let nodes = self.nodes[0].cli(&["CLUSTER", "NODES"]);
        for line in nodes.lines() {
            let fields: Vec<&str> = line.split_whitespace().collect();
            let Some(port) = fields
                .get(1)
                .and_then(|a| a.split('@').next())
                .and_then(|a| a.rsplit(':').next())
                .and_then(|p| p.parse::<u16>().ok())
            else {
                continue;
            };
            let serves = fields.iter().skip(8).any(|range| {
                let (low, high) = range.split_once('-').unwrap_or((range, range));
                matches!((low.parse::<u16>(), high.parse::<u16>()), (Ok(l), Ok(h)) if (l..=h).contains(&slot))
            });
            if serves {
                return self
                    .nodes
                    .iter()
                    .find(|n| n.port() == port)
                    .expect("a node of this cluster");
            }
        }
        panic!("no node serves slot {slot}:\n{nodes}");
    }

    /// The node that serves a key's hash slot.
    pub(crate) fn node_of_key(&self, key: &str) -> &RedisServer {
        self.node_of_slot(fred::util::redis_keyslot(key.as_bytes()))
    }

    /// Makes `node` announce `port` as its own (a proxy in front of it: clients that read
    /// the cluster's slots then connect to it through the proxy), and waits until every
    /// node tells it so.
    pub(crate) fn announce_port(&self, node: &RedisServer, port: u16) {
        let announced = port.to_string();
        assert_eq!(
            node.cli(&["CONFIG", "SET", "cluster-announce-port", &announced]).trim(),
            "OK"
        );
        let deadline = Instant::now() + Duration::from_secs(20);
        while !self
            .nodes
            .iter()
            .all(|n| n.cli(&["CLUSTER", "NODES"]).contains(&format!(":{announced}@")))
        {
            assert!(Instant::now() < deadline, "the nodes did not learn the announced port");
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// A node of the cluster other than `node`.
    pub(crate) fn another_node(&self, node: &RedisServer) -> &RedisServer {
        self.nodes
            .iter()
            .find(|n| n.port() != node.port())
            .expect("a cluster of several nodes")
    }

    /// Starts moving `slot` to another node (see [`RedisCluster::start_migrating_to`]);
    /// returns its node and that one.
    pub(crate) fn start_migrating(&self, slot: u16) -> (&RedisServer, &RedisServer) {
        let target = self.another_node(self.node_of_slot(slot));
        (self.start_migrating_to(slot, target), target)
    }

    /// Starts moving `slot` to `target` (`CLUSTER SETSLOT … IMPORTING` there, `MIGRATING`
    /// at its node), as a resharding does, without moving any key; returns its node.
    pub(crate) fn start_migrating_to(&self, slot: u16, target: &RedisServer) -> &RedisServer {
        let source = self.node_of_slot(slot);
        let (source_id, target_id, s) = (source.cluster_id(), target.cluster_id(), slot.to_string());
        assert_eq!(
            target.cli(&["CLUSTER", "SETSLOT", &s, "IMPORTING", &source_id]).trim(),
            "OK"
        );
        assert_eq!(
            source.cli(&["CLUSTER", "SETSLOT", &s, "MIGRATING", &target_id]).trim(),
            "OK"
        );
        source
    }
}

/// A primary, a replica and three sentinels monitoring them as `mymaster`.
pub(crate) struct RedisSentinels {
    pub(crate) primary: RedisServer,
    pub(crate) replica: RedisServer,
    sentinels: Vec<(Child, u16)>,
    dir: PathBuf,
}

impl RedisSentinels {
    pub(crate) fn start() -> Self {
        let primary = RedisServer::start();
        let replica = RedisServer::start_with(&["--replicaof", "127.0.0.1", &primary.port.to_string()]);
        let dir = std::env::temp_dir().join(format!("fluxgate-sentinels-{}-{}", std::process::id(), primary.port));
        std::fs::create_dir_all(&dir).unwrap();
        let mut sentinels = Vec::new();
        for i in 0..3 {
            let port = free_port();
            let conf = dir.join(format!("sentinel-{i}.conf"));
            std::fs::write(
                &conf,
                format!(
                    "port {port}\nbind 127.0.0.1\ndir {}\nsentinel monitor mymaster 127.0.0.1 {} 2\n\
                     sentinel down-after-milliseconds mymaster 1000\nsentinel failover-timeout mymaster 5000\n\
                     sentinel parallel-syncs mymaster 1\n",
                    dir.display(),
                    primary.port
                ),
            )
            .unwrap();
            let child = Command::new("redis-server")
                .arg(&conf)
                .arg("--sentinel")
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .expect("start redis-server --sentinel (package redis-sentinel)");
            sentinels.push((child, port));
        }
        let this = Self {
            primary,
            replica,
            sentinels,
            dir,
        };
        // Every sentinel knows the primary, its replica and the other sentinels.
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let ready = this.sentinels.iter().all(|(_, port)| {
                let replicas = sentinel_cli(*port, &["SENTINEL", "REPLICAS", "mymaster"]);
                let others = sentinel_cli(*port, &["SENTINEL", "SENTINELS", "mymaster"]);
                replicas.contains(&this.replica.port.to_string()) && others.matches("runid").count() >= 2
            });
            if ready {
                return this;
            }
            assert!(Instant::now() < deadline, "the sentinels did not discover each other");
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// `redis-sentinel://s1?node=s2&node=s3&sentinelServiceName=mymaster`.
    pub(crate) fn url(&self) -> String {
        let ports: Vec<u16> = self.sentinels.iter().map(|(_, p)| *p).collect();
        format!(
            "redis-sentinel://127.0.0.1:{}?node=127.0.0.1:{}&node=127.0.0.1:{}&sentinelServiceName=mymaster",
            ports[0], ports[1], ports[2]
        )
    }

    /// The port of the primary the sentinels currently name.
    pub(crate) fn primary_port(&self) -> Option<u16> {
        let out = sentinel_cli(
            self.sentinels[0].1,
            &["SENTINEL", "GET-MASTER-ADDR-BY-NAME", "mymaster"],
        );
        out.lines().nth(1).and_then(|p| p.trim().parse().ok())
    }
}

fn sentinel_cli(port: u16, args: &[&str]) -> String {
    let out = Command::new("redis-cli")
        .args(["-p", &port.to_string()])
        .args(args)
        .output()
        .expect("redis-cli");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

impl Drop for RedisSentinels {
    fn drop(&mut self) {
        for (child, _) in &mut self.sentinels {
            let _ = child.kill();
            let _ = child.wait();
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
