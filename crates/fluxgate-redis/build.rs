//! Joins the Redis scripts from their files, one per algorithm, into the scripts the crate
//! sends (`DECIDE_LUA`, `REFUND_LUA`, for token buckets alone `ONE_TOKEN_BUCKET_LUA` and
//! `TOKEN_BUCKETS_LUA`, and the three in one call for batched decisions, `BATCH_LUA`),
//! written to `OUT_DIR`; and the loop of a rule's own batch script (`rule_batch.lua`).
//!
//! The files have one home, `lua/` at the top of the repository. The crate reaches it
//! through its `lua` link, which `cargo package` follows, so that a packaged crate carries
//! the files themselves. A checkout without symbolic links (Git's `core.symlinks=false`)
//! turns the link into a small text file: then the files are read from `../../lua`.

use std::path::{Path, PathBuf};
use std::{env, fs};

/// The parts the general decision script and the refund script share, in order.
const PARTS: &[&str] = &[
    "common.lua",
    "protocol.lua",
    "layout.lua",
    "token_bucket.lua",
    "helpers.lua",
    "leaky_bucket.lua",
    "fixed_window.lua",
    "sliding_window_log.lua",
    "sliding_window_counter.lua",
    "algorithms.lua",
];

/// A script's parts: the shared ones, then `last`.
fn parts(last: &'static str) -> Vec<&'static str> {
    PARTS.iter().copied().chain([last]).collect()
}

fn scripts_dir(manifest: &Path) -> PathBuf {
    let candidates = [manifest.join("lua"), manifest.join("../../lua")];
    for dir in &candidates {
        if dir.join("decide.lua").is_file() {
            return dir.clone();
        }
    }
    panic!(
        "the Redis scripts are missing: neither {} nor {} holds decide.lua",
        candidates[0].display(),
        candidates[1].display()
    );
}

fn join(dir: &Path, parts: &[&str], out: &Path) {
    if let Err(e) = fs::write(out, read(dir, parts)) {
        panic!("cannot write {}: {e}", out.display());
    }
}

/// The text of `parts`, joined.
fn read(dir: &Path, parts: &[&str]) -> String {
    let mut script = String::new();
    for part in parts {
        let path = dir.join(part);
        println!("cargo:rerun-if-changed={}", path.display());
        match fs::read_to_string(&path) {
            Ok(text) => script.push_str(&text),
            Err(e) => panic!("cannot read the Redis script part {}: {e}", path.display()),
        }
    }
    script
}

/// The batch script: each decision script as a function of its own keys and arguments,
/// reading the clock the batch read once (and converted once), then `batch.lua`.
fn batch(dir: &Path, out: &Path) {
    const TIME: &str = "local time = redis.call('TIME')\nlocal now = time[1] * 1000000 + time[2]\n";
    const ONE_REPLY: &str = "return {now, debt}\n";
    let mut script = String::from(
        "local batch_time = redis.call('TIME')\nlocal batch_now = batch_time[1] * 1000000 + batch_time[2]\n",
    );
    let general = parts("decide.lua");
    let functions: [(&str, &[&str]); 3] = [
        ("decide_one", &["one_token_bucket.lua"]),
        ("decide_token_buckets", &["layout.lua", "token_buckets.lua"]),
        ("decide_general", &general),
    ];
    for (name, parts) in functions {
        let mut body = read(dir, parts);
        assert_eq!(
            body.matches(TIME).count(),
            1,
            "the batch script needs exactly one {TIME} in the parts of {name}"
        );
        body = body.replace(TIME, "local now = batch_now\n");
        if name == "decide_one" {
            // The batch's reply holds `now` once: the one-band call's reply is its debt
            // alone, a number rather than a table.
            assert_eq!(
                body.matches(ONE_REPLY).count(),
                1,
                "the batch script needs exactly one {ONE_REPLY} in the one-band call"
            );
            body = body.replace(ONE_REPLY, "return debt\n");
        }
        script.push_str(&format!("local {name} = function(KEYS, ARGV)\n{body}\nend\n"));
    }
    script.push_str(&read(dir, &["batch.lua"]));
    if let Err(e) = fs::write(out, script) {
        panic!("cannot write {}: {e}", out.display());
    }
}

fn main() {
    let manifest = PathBuf::from(env::var_os("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR"));
    let out = PathBuf::from(env::var_os("OUT_DIR").expect("cargo sets OUT_DIR"));
    let dir = scripts_dir(&manifest);
    println!("cargo:rerun-if-changed={}", manifest.join("lua").display());
    join(&dir, &parts("decide.lua"), &out.join("decide.lua"));
    join(&dir, &parts("refund.lua"), &out.join("refund.lua"));
    join(&dir, &["one_token_bucket.lua"], &out.join("one_token_bucket.lua"));
    join(
        &dir,
        &["layout.lua", "token_buckets.lua"],
        &out.join("token_buckets.lua"),
    );
    join(&dir, &["protocol.lua"], &out.join("protocol.lua"));
    // The loop of a rule's own batch script, which the crate writes after the rule's
    // one-band function (`src/rule_script.rs`).
    join(&dir, &["rule_batch.lua"], &out.join("rule_batch.lua"));
    batch(&dir, &out.join("batch.lua"));
}
