//! Tests of the protocol between the crate and its scripts.

use super::*;

/// The Lua side's names of the numbers, part of both scripts.
const PROTOCOL_LUA: &str = include_str!(concat!(env!("OUT_DIR"), "/protocol.lua"));

const ALGORITHMS: [(ScriptAlgorithm, &str); 5] = [
    (ScriptAlgorithm::TokenBucket, "TOKEN_BUCKET"),
    (ScriptAlgorithm::LeakyBucket, "LEAKY_BUCKET"),
    (ScriptAlgorithm::FixedWindow, "FIXED_WINDOW"),
    (ScriptAlgorithm::SlidingWindowLog, "SLIDING_WINDOW_LOG"),
    (ScriptAlgorithm::SlidingWindowCounter, "SLIDING_WINDOW_COUNTER"),
];

/// `lua/protocol.lua` names the numbers this module sends.
#[test]
fn the_scripts_know_the_same_numbers() {
    for (algorithm, name) in ALGORITHMS {
        let line = format!("\nlocal {name} = {}\n", algorithm.number());
        assert!(PROTOCOL_LUA.contains(&line), "{line:?}");
    }
    for (name, value) in [
        ("FLAG_SHADOW", Flags::SHADOW),
        ("FLAG_ALGORITHM", Flags::ALGORITHM),
        ("FLAG_WAITS", Flags::WAITS),
        ("FLAG_BANDS", Flags::BANDS),
        ("CALL_MARKS", CALL_MARKS),
    ] {
        let line = format!("\nlocal {name} = {value}\n");
        assert!(PROTOCOL_LUA.contains(&line), "{line:?}");
    }
}

#[test]
fn flags() {
    for (algorithm, _) in ALGORITHMS {
        for bands in [1, 2, 15, 16, 1000] {
            for (shadow, waits) in [(false, false), (true, false), (false, true), (true, true)] {
                let mut flags = Flags::new(bands, algorithm, shadow);
                if waits {
                    flags = flags.waiting();
                }
                assert_eq!(flags.bands(), i64::try_from(bands).unwrap());
                assert_eq!(flags.algorithm(), algorithm.number());
                assert_eq!(flags.is_shadow(), shadow);
                assert_eq!(flags.waits(), waits);
            }
        }
    }
    assert_eq!(Flags::new(2, ScriptAlgorithm::FixedWindow, true).get(), 69);
    assert_eq!(Flags::new(2, ScriptAlgorithm::FixedWindow, true).waiting().get(), 85);
}

fn text(values: &[Value]) -> Vec<String> {
    values
        .iter()
        .map(|v| match v {
            Value::Integer(n) => n.to_string(),
            Value::String(s) => s.to_string(),
            other => format!("{other:?}"),
        })
        .collect()
}

fn rule(bucket: BucketArgs, bands: &[BandArgs]) -> Arc<RuleArgs> {
    Arc::new(RuleArgs::new(bucket, bands.iter().copied().collect()))
}

fn tb(bands: usize, shadow: bool, permits: i64) -> BucketArgs {
    BucketArgs {
        permits,
        flags: Flags::new(bands, ScriptAlgorithm::TokenBucket, shadow),
        layout: Some(Str::from_static("b0:10/1s|")),
        max_wait_us: 0,
    }
}

#[test]
fn decide_args() {
    let mut args = DecideArgs::new();
    let band = BandArgs {
        capacity: 10,
        a: 1,
        b: 360,
    };
    args.rule(rule(tb(2, false, 1), &[band, band]));
    // A fixed window the request may wait 2.5 s for: its flags say so, its wait follows.
    args.rule(rule(
        BucketArgs {
            permits: 3,
            flags: Flags::new(1, ScriptAlgorithm::FixedWindow, false),
            layout: None,
            max_wait_us: 2_500_000,
        },
        &[BandArgs {
            capacity: 5,
            a: 60_000_000,
            b: 0,
        }],
    ));
    assert_eq!(
        text(&args.general_argv()),
        [
            "2",
            "1",
            "64",
            "b0:10/1s|",
            "10",
            "1",
            "360",
            "10",
            "1",
            "360",
            "3",
            "52",
            "2500000",
            "5",
            "60000000",
            "0"
        ]
    );
    // A call asking for the bands' marks says so with its bucket count.
    args.mark_places();
    assert_eq!(text(&args.general_argv())[0], "65538");
}

#[test]
fn shapes_choose_the_script() {
    let band = BandArgs {
        capacity: 10,
        a: 7,
        b: 360,
    };
    for shadow in [false, true] {
        let mut args = DecideArgs::new();
        args.rule(rule(tb(1, shadow, 1), &[band]));
        assert_eq!(args.shape(), Shape::OneTokenBucket);
        // 10 × 360 = 0xe10 units, a cost of 360 = 0x168, 3600 / 7 = 514 µs: 0 ms + 1001,
        // scale 7.
        let argv = args.one_token_bucket_argv().unwrap();
        assert_eq!(text(&argv), ["b0:10/1s|", "e10", "168", "1001", "7"]);
    }
    let mut args = DecideArgs::new();
    args.rule(rule(
        tb(1, false, 3),
        &[BandArgs {
            capacity: 10_000_000,
            a: 1,
            b: 360,
        }],
    ));
    // An hour: 3,600,000 ms + 1001; a scale of 1 left out; a cost of 3 × 360.
    let argv = args.one_token_bucket_argv().unwrap();
    assert_eq!(text(&argv), ["b0:10/1s|", "d693a400", "438", "3601001"]);
    let mut args = DecideArgs::new();
    args.rule(rule(tb(2, false, 1), &[band, band]));
    assert_eq!(args.shape(), Shape::TokenBuckets);
    assert_eq!(args.one_token_bucket_argv(), None);
    // More permits than the capacity cost one unit more than the band holds.
    args.rule(rule(tb(1, true, 99), &[band]));
    assert_eq!(
        text(&args.token_buckets_argv()),
        [
            "12",
            "b0:10/1s|",
            "1001",
            "e10",
            "168",
            "7",
            "e10",
            "168",
            "7",
            "b",
            "b0:10/1s|",
            "1001",
            "e10",
            "f78",
            "7"
        ]
    );
    // A rule whose bands all have a scale of 1 sends no scales; its key outlives its
    // longest window (3.6 s) by a second.
    let mut unscaled = DecideArgs::new();
    let band = BandArgs { a: 1, ..band };
    let long = BandArgs { b: 360_000, ..band };
    unscaled.rule(rule(tb(2, false, 2), &[band, long]));
    assert_eq!(
        text(&unscaled.token_buckets_argv()),
        ["10", "b0:10/1s|", "4601", "e10", "2d0", "36ee80", "afc80"]
    );
    args.rule(rule(
        BucketArgs {
            permits: 1,
            flags: Flags::new(1, ScriptAlgorithm::LeakyBucket, false),
            layout: None,
            max_wait_us: 0,
        },
        &[band],
    ));
    assert_eq!(args.shape(), Shape::General);
}

/// A token-bucket reply: the script returns each band's debt, the verdicts and figures
/// follow as the script decided.
#[test]
fn token_replies() {
    // 10 per 3,600 µs at scale 1: a permit costs 360 units, the band holds 3,600.
    let band = BandArgs {
        capacity: 10,
        a: 1,
        b: 360,
    };
    for (debt, shadow, verdicts, remaining, wait) in [
        (0, false, (true, true), 9, Wait::None),
        (3_600, false, (false, true), 0, Wait::After(Duration::from_micros(360))),
        (3_500, false, (false, true), 0, Wait::After(Duration::from_micros(260))),
        (3_240, true, (true, true), 0, Wait::None),
        (3_600, true, (true, false), 0, Wait::After(Duration::from_micros(360))),
    ] {
        let mut args = DecideArgs::new();
        args.rule(rule(tb(1, shadow, 1), &[band]));
        let reply = args.token_reply(&[42, debt]).unwrap();
        assert_eq!((reply.allowed, reply.shadow_allowed), verdicts, "{debt}");
        assert_eq!(reply.now_us, 42);
        let bands: Vec<_> = reply.bands().collect();
        assert_eq!(bands.len(), 1);
        assert_eq!(bands[0].allowed, wait == Wait::None);
        assert_eq!(bands[0].remaining, remaining, "{debt}");
        assert_eq!(bands[0].wait, wait, "{debt}");
    }
    // A debt out of range (a state written by hand): a full band, never a panic, and
    // the verdict and the band's report agree.
    for debt in [-1, i64::MIN, i64::MAX] {
        let mut args = DecideArgs::new();
        args.rule(rule(tb(1, false, 1), &[band]));
        let reply = args.token_reply(&[42, debt]).unwrap();
        let bands: Vec<_> = reply.bands().collect();
        assert_eq!(reply.allowed, debt < 0, "{debt}");
        assert_eq!(bands[0].allowed, reply.allowed, "{debt}");
    }
    // Two rules: the second rejects, so the first commits nothing.
    let mut args = DecideArgs::new();
    args.rule(rule(tb(1, false, 1), &[band]));
    args.rule(rule(tb(1, false, 11), &[band]));
    let reply = args.token_reply(&[42, 360, 0]).unwrap();
    assert!(!reply.allowed);
    let bands: Vec<_> = reply.bands().collect();
    assert_eq!(
        bands,
        [
            BandReply {
                allowed: true,
                remaining: 9,
                reset_after: Duration::from_micros(360),
                wait: Wait::None,
            },
            BandReply {
                allowed: false,
                remaining: 10,
                reset_after: Duration::ZERO,
                wait: Wait::Never,
            },
        ]
    );
    assert!(args.token_reply(&[42, 0]).is_err());
    assert!(args.token_reply(&[]).is_err());
}

/// A request that may wait: its longest wait in the arguments, and the key's expiry
/// past it.
#[test]
fn waiting_arguments() {
    let band = BandArgs {
        capacity: 10,
        a: 1,
        b: 360,
    };
    let waiting = |bands: &[BandArgs]| {
        let mut args = DecideArgs::new();
        args.rule(rule(
            BucketArgs {
                max_wait_us: 2_500_000,
                ..tb(bands.len(), false, 1)
            },
            bands,
        ));
        args
    };
    // One band: the scale (1) is sent, then the wait (2.5 s = 0x2625a0 µs); the key
    // outlives the window (3.6 ms) and the wait by a second: 2,503.6 ms, rounded
    // down, + 1001.
    let argv = waiting(&[band]).one_token_bucket_argv().unwrap();
    assert_eq!(text(&argv), ["b0:10/1s|", "e10", "168", "3504", "1", "2625a0"]);
    // Several: the flags say the rule waits (2 × 8 + 4), the wait follows the expiry.
    assert_eq!(
        text(&waiting(&[band, band]).token_buckets_argv()),
        ["14", "b0:10/1s|", "3504", "2625a0", "e10", "168", "e10", "168"]
    );
}

/// A token-bucket reply when the request may wait: the verdicts and figures of the
/// request admitted later, its place taken now, as the scripts decide.
#[test]
fn waiting_replies() {
    // 10 per 3,600 µs at scale 1: a permit costs 360 units, the band holds 3,600.
    let band = BandArgs {
        capacity: 10,
        a: 1,
        b: 360,
    };
    let waits = |max_wait_us| BucketArgs {
        max_wait_us,
        ..tb(1, false, 1)
    };
    for (debt, max_wait_us, admitted_after_us) in [
        // A full bucket: admitted now, whatever the wait.
        (3_240, 1_000, Some(0)),
        // Empty: the next permit in 360 µs.
        (3_600, 1_000, Some(360)),
        (3_600, 360, Some(360)),
        (3_600, 359, None),
        // Three waiters ahead: the fourth place, 4 × 360 µs ahead.
        (4_680, 2_000, Some(1_440)),
        (4_680, 1_439, None),
    ] {
        let mut args = DecideArgs::new();
        args.rule(rule(waits(max_wait_us), &[band]));
        let reply = args.token_reply(&[42, debt]).unwrap();
        assert_eq!(reply.allowed, admitted_after_us.is_some(), "{debt} {max_wait_us}");
        assert_eq!(reply.admitted_after_us, admitted_after_us.unwrap_or(0));
        let [b]: [BandReply; 1] = reply.bands().collect::<Vec<_>>().try_into().unwrap();
        if admitted_after_us.is_some() {
            // Committed: the debt grows by the cost, past the capacity while waiting.
            assert_eq!(b.wait, Wait::None);
            assert_eq!(b.reset_after, Duration::from_micros((debt + 360) as u64));
        } else {
            // Refused: the wait counts every place taken ahead.
            assert_eq!(b.wait, Wait::After(Duration::from_micros((debt + 360 - 3_600) as u64)));
        }
        // Every permit taken: none remains.
        assert_eq!(b.remaining, 0);
    }

    // Two rules: the second, waiting, needs 720 µs; the first admits now and its instant
    // lies 1,000 µs ahead, past 720: it takes its place then as now.
    let mut args = DecideArgs::new();
    args.rule(rule(tb(1, false, 1), &[band]));
    args.rule(rule(waits(1_000), &[band]));
    let reply = args.token_reply(&[42, 1_000, 3_960]).unwrap();
    assert!(reply.allowed);
    assert_eq!(reply.admitted_after_us, 720);
    let bands: Vec<_> = reply.bands().collect();
    assert_eq!(bands[0].remaining, (3_600 - 1_360) / 360);
    assert!(bands.iter().all(|b| b.allowed));
    // The first rule's instant lies only 500 µs ahead: taking its place 720 µs ahead
    // would move it on, holding back its other requests: refused at once.
    let reply = args.token_reply(&[42, 500, 3_960]).unwrap();
    assert!(!reply.allowed);
    assert_eq!(reply.admitted_after_us, 0);
    // With a shadow rule that admits now but not 720 µs ahead (its instant lies before
    // then): refused, and the shadow rule's verdict is now's.
    let mut shadowed = args.clone();
    shadowed.rule(rule(tb(1, true, 1), &[band]));
    let reply = shadowed.token_reply(&[42, 500, 3_960, 0]).unwrap();
    assert_eq!((reply.allowed, reply.shadow_allowed), (false, true));
    // A rule that may not wait refuses at once, whatever the others allow.
    let reply = args.token_reply(&[42, 3_600, 0]).unwrap();
    assert!(!reply.allowed);
    // A shadow rule never makes a request wait.
    let mut args = DecideArgs::new();
    args.rule(rule(
        BucketArgs {
            max_wait_us: 1_000,
            ..tb(1, true, 1)
        },
        &[band],
    ));
    let reply = args.token_reply(&[42, 3_600]).unwrap();
    assert_eq!(
        (reply.allowed, reply.shadow_allowed, reply.admitted_after_us),
        (true, false, 0)
    );
}

#[test]
fn refund_args() {
    let mut args = RefundArgs::new(1_700_000_000_000_000, 1_699_999_999_000_000);
    args.band(&RefundBand {
        algorithm: ScriptAlgorithm::SlidingWindowCounter,
        permits: 3,
        band: BandArgs {
            capacity: 10,
            a: 60_000_000,
            b: 0,
        },
        place: None,
        expect: None,
    });
    args.band(&RefundBand {
        algorithm: ScriptAlgorithm::TokenBucket,
        permits: 1,
        band: BandArgs {
            capacity: 10,
            a: 1,
            b: 360,
        },
        place: Some(RulePlace {
            layout: Str::from_static("b0:10/1s|"),
            index: 1,
            count: 1,
        }),
        expect: Some("6553f100:3".to_owned()),
    });
    assert_eq!(
        text(&args.into_argv()),
        [
            "1700000000000000",
            "1699999999000000",
            "4",
            "3",
            "10",
            "60000000",
            "0",
            "0",
            "1",
            "10",
            "1",
            "360",
            "b0:10/1s|",
            "1",
            "1",
            "6553f100:3"
        ]
    );
}

/// A waiting request's marks: each committed band's state after it, as the scripts
/// write it.
#[test]
fn marks_of_a_waiting_request() {
    // 10 per 3,600 µs at scale 7 (a permit costs 360 units, 51 3/7 µs).
    let band = BandArgs {
        capacity: 10,
        a: 7,
        b: 360,
    };
    let mut args = DecideArgs::new();
    args.rule(rule(
        BucketArgs {
            max_wait_us: 1_000,
            ..tb(1, false, 1)
        },
        &[band],
    ));
    // Full: 3,600 units of debt; the request's place 360 units past the capacity.
    let reply = args.token_reply(&[1_000, 3_600]).unwrap();
    assert_eq!(reply.admitted_after_us, 52);
    // After: 3,960 units = 565 µs and 5 units (565 × 7 = 3,955).
    assert_eq!(reply.marks, [(1_565u128 << 64) | 5]);
    assert_eq!(expected_state(reply.marks[0]).as_deref(), Some("61d:5"));
    assert_eq!(expected_state((0x61d_u128) << 64).as_deref(), Some("61d"));
    assert_eq!(expected_state(0), None);
    // Admitted at once: no marks.
    assert!(args.token_reply(&[1_000, 0]).unwrap().marks.is_empty());
}

#[test]
fn replies() {
    let reply = Reply::decode(&[1, 0, 42, 0, 1, 9, 100, 0, 0, 0, 7, -1], 2, false).unwrap();
    assert!(reply.allowed && !reply.shadow_allowed);
    assert_eq!(reply.now_us, 42);
    assert_eq!(reply.admitted_after_us, 0);
    assert!(reply.marks.is_empty());
    let bands: Vec<_> = reply.bands().collect();
    assert_eq!(
        bands,
        [
            BandReply {
                allowed: true,
                remaining: 9,
                reset_after: Duration::from_micros(100),
                wait: Wait::None,
            },
            BandReply {
                allowed: false,
                remaining: 0,
                reset_after: Duration::from_micros(7),
                wait: Wait::Never,
            },
        ]
    );
    // Admitted 30 µs later: each band's mark follows the figures (0 for a window band).
    let later = Reply::decode(&[1, 1, 42, 30, 1, 0, 1_530, 0, 1, 2, 60, 0, 1_572, 3, 0, 0], 2, false).unwrap();
    assert!(later.allowed && later.shadow_allowed);
    assert_eq!(later.admitted_after_us, 30);
    assert_eq!(later.marks, [(1_572u128 << 64) | 3, 0]);
    assert_eq!(expected_leaky_state(later.marks[0]).as_deref(), Some("1572:3"));
    assert_eq!(expected_leaky_state(1_572u128 << 64).as_deref(), Some("1572:0"));
    assert_eq!(expected_leaky_state(0), None);
    assert_eq!(later.bands().count(), 2);
    // Admitted at once, its marks asked for (a lease's call).
    let marked = Reply::decode(&[1, 1, 42, 0, 1, 5, 900, 0, 1_042, 7], 1, true).unwrap();
    assert_eq!(marked.marks, [(1_042u128 << 64) | 7]);
    assert!(Reply::decode(&[1, 1, 42, 0, 1, 5, 900, 0], 1, true).is_err());
    let refunded = RefundReply::decode(vec![3, 50, -1, 0], 2).unwrap();
    let refunded: Vec<_> = refunded.bands().collect();
    assert_eq!(refunded[0].remaining, 3);
    assert_eq!(refunded[1].remaining, 0);
}

/// A reply of the wrong length is an error naming what came, never a panic.
#[test]
fn malformed_replies() {
    for (numbers, bands) in [
        (vec![], 0),
        (vec![1, 1, 5], 0),
        (vec![1, 1, 5, 0], 1),
        (vec![1, 1, 5, 0, 1, 2, 3, 4, 5], 1),
        // Admitted later: the marks are missing.
        (vec![1, 1, 5, 9, 1, 2, 3, 4], 1),
    ] {
        let error = Reply::decode(&numbers, bands, false).unwrap_err();
        assert_eq!(
            error.to_string(),
            format!(
                "unexpected reply from the rate-limit script: {} numbers for {bands} bands",
                numbers.len()
            )
        );
    }
    assert!(Reply::decode(&[1, 1, 5, 0], 0, false).is_ok());
    assert!(RefundReply::decode(vec![1, 2, 3], 2).is_err());
}
