//! State lost or stepped: cold starts, restarts and clock steps, in both stores.

use super::*;

/// A bucket the store made full (its first caller had no evidence) while another proxy has
/// evidence that it was nearly spent: that caller empties it.
async fn evidence_empties_a_bucket_made_anew(store: &Store) {
    let ttl = 10_000;
    // Evidence that agrees with the bucket changes nothing.
    let g = store.lease("other", &[rated("fine")], ttl).await.unwrap()[0];
    assert_eq!(g.remaining, 75);
    let g = store
        .lease("other", &[known("fine", 1, 75)], ttl)
        .await
        .unwrap()[0];
    assert_eq!(g.granted, 25);
    let g = store.lease("new", &[rated("late")], ttl).await.unwrap()[0];
    assert_eq!(g.granted, 25, "no evidence: full");
    let g = store
        .lease("old", &[known("late", 500, 3)], ttl)
        .await
        .unwrap()[0];
    // Emptied but for the newcomers' reserve (12): 3 + 1 + 100/s × 0.5 s < 75 left. The rate
    // is held for the holders of before, and the caller, one of them, takes what it asks for of
    // it (so not the reserve: that is for those left short).
    assert_eq!((g.granted, g.remaining, g.rate), (0, 0, 50.0), "{g:?}");
}

/// A key whose hash tag (`tg:lim:<key>`) is in the same Redis slot as key `k`'s, so that both
/// share one epoch marker.
fn same_slot_as_k() -> String {
    let slot = |key: &str| {
        crc16::State::<crc16::XMODEM>::calculate(format!("tg:lim:{key}").as_bytes()) % 16_384
    };
    (0..)
        .map(|n| format!("k{n}"))
        .find(|key| slot(key) == slot("k"))
        .unwrap()
}

/// The automatic cold start, as a new deployment and across a loss of state: `before` serves a
/// new deployment; `after` is the store once `lose` made it lose everything (`before`
/// restarted, or flushed).
async fn auto_cold_start_story(
    before: &Store,
    lose: impl std::future::Future<Output = ()>,
    after: &Store,
) {
    let ttl = 10_000;
    // A new deployment serves its limits at once: the burst, and the rate.
    let g = before.lease("a", &[rated("k")], ttl).await.unwrap()[0];
    assert_eq!((g.granted, g.rate, g.remaining), (25, 50.0, 75));
    lose.await;
    // After the loss, the proxy that was answered calls with its evidence: the store lost the
    // bucket, which starts empty but for the newcomers' reserve (12), with its rate held for a
    // TTL for the holders of before. The caller is one of them: it renews what it asks for of
    // that rate at once (and so leaves the reserve to those left short).
    let g = after
        .lease("a", &[known("k", 1_200, 75)], ttl)
        .await
        .unwrap()[0];
    assert_eq!(
        (g.granted, g.remaining, g.rate),
        (0, 0, 50.0),
        "lost: {g:?}"
    );
    // Another proxy with evidence takes the rest; none is left for a third.
    let g = after
        .lease("c", &[known("k", 1_000, 75)], ttl)
        .await
        .unwrap()[0];
    assert_eq!((g.granted, g.rate), (0, 50.0), "{g:?}");
    // A third, left with no share, gets the reserve (12), then nothing.
    let g = after.lease("d", &[known("k", 900, 75)], ttl).await.unwrap()[0];
    assert_eq!((g.granted, g.rate), (12, 0.0), "{g:?}");
    let g = after.lease("d", &[known("k", 1, 0)], ttl).await.unwrap()[0];
    assert_eq!((g.granted, g.rate), (0, 0.0), "{g:?}");
    assert!((5_000..=10_000).contains(&g.retry_ms), "{g:?}");
    // The store (on Redis: the slot) is known to have lost state: a key it does not know starts
    // conservatively too, evidence or not.
    let g = after
        .lease("b", &[rated(&same_slot_as_k())], ttl)
        .await
        .unwrap()[0];
    assert_eq!(
        (g.granted, g.rate),
        (12, 0.0),
        "lost state: conservative, but the reserve"
    );
}

/// Redis stores take the cold-start mode; each slot's marker has its own epoch.
const CONSERVATIVE: ColdStart = ColdStart::Conservative { epoch_ms: 0 };

#[tokio::test]
async fn a_store_that_lost_its_buckets_starts_cold() {
    let ttl = 10_000;
    // Memory: every start is one; the bucket grants only the newcomers' reserve (an eighth of
    // the burst) for a lease TTL, then nothing, and says when.
    let memory = Store::Memory(MemoryStore::new(
        100,
        ColdStart::Conservative {
            epoch_ms: tollgate_quota::store::now_ms(),
        },
    ));
    let items = [LeaseItem {
        requests: 100,
        per_ms: 1_000,
        demand: 50.0,
        ..item("k", 100, 25)
    }];
    let g = memory.lease("a", &items, ttl).await.unwrap()[0];
    assert_eq!((g.granted, g.rate), (12, 0.0));
    let g = memory.lease("a", &items, ttl).await.unwrap()[0];
    assert_eq!((g.granted, g.rate), (0, 0.0));
    assert!((9_000..=10_000).contains(&g.retry_ms), "{g:?}");
    // Redis: a bucket missing from a slot whose epoch marker is young starts cold, and a Redis
    // that lost everything (FLUSHALL, or a restart without persistence) is young again.
    let redis = Redis::start();
    let store = Store::Redis(
        RedisStore::connect(&single(&redis), Duration::from_millis(200), CONSERVATIVE)
            .await
            .unwrap(),
    );
    let g = store.lease("a", &items, ttl).await.unwrap()[0];
    assert_eq!((g.granted, g.rate), (12, 0.0));
    let g = store.lease("a", &items, ttl).await.unwrap()[0];
    assert_eq!((g.granted, g.rate), (0, 0.0));
    let client = redis::Client::open(redis.url()).unwrap();
    let mut conn = client.get_multiplexed_async_connection().await.unwrap();
    // Age every slot's marker by an hour: new buckets then start full.
    let markers: Vec<String> = redis::cmd("KEYS")
        .arg("{tg-epoch-*}")
        .query_async(&mut conn)
        .await
        .unwrap();
    assert_eq!(markers.len(), 1, "one slot used so far");
    let hour_ago = tollgate_quota::store::now_ms() - 3_600_000;
    let _: () = redis::cmd("SET")
        .arg(&markers[0])
        .arg(hour_ago)
        .query_async(&mut conn)
        .await
        .unwrap();
    // A bucket that went away because it was idle (here: deleted) while the slot's marker is
    // old: it starts full.
    let _: () = redis::cmd("DEL")
        .arg("{tg:lim:k}:b")
        .query_async(&mut conn)
        .await
        .unwrap();
    let g = store.lease("a", &items, ttl).await.unwrap()[0];
    assert_eq!((g.granted, g.rate), (25, 50.0));
    let _: () = redis::cmd("FLUSHALL").query_async(&mut conn).await.unwrap();
    let g = store.lease("a", &items, ttl).await.unwrap()[0];
    assert_eq!(
        (g.granted, g.rate),
        (12, 0.0),
        "lost data: cold again, but the reserve"
    );
}

#[tokio::test]
async fn auto_cold_start_serves_a_new_deployment_and_holds_the_limit_after_a_loss() {
    let auto = || ColdStart::Auto {
        epoch_ms: tollgate_quota::store::now_ms(),
    };
    // Memory: the loss is a restart.
    let first = Store::Memory(MemoryStore::new(100, auto()));
    let restarted = Store::Memory(MemoryStore::new(100, auto()));
    auto_cold_start_story(&first, async {}, &restarted).await;
    evidence_empties_a_bucket_made_anew(&Store::Memory(MemoryStore::new(100, auto()))).await;
    // Redis: the loss is a flush (a restart without persistence, a node replaced).
    let redis = Redis::start();
    let store = Store::Redis(
        RedisStore::connect(&single(&redis), Duration::from_millis(200), auto())
            .await
            .unwrap(),
    );
    let client = redis::Client::open(redis.url()).unwrap();
    let mut conn = client.get_multiplexed_async_connection().await.unwrap();
    let flush = || {
        let mut conn = conn.clone();
        async move {
            let _: () = redis::cmd("FLUSHALL").query_async(&mut conn).await.unwrap();
        }
    };
    auto_cold_start_story(&store, flush(), &store).await;
    let _: () = redis::cmd("FLUSHALL").query_async(&mut conn).await.unwrap();
    evidence_empties_a_bucket_made_anew(&store).await;
    // Lost writes (a failover to a replica that missed them): the bucket is back to where it was
    // before a grant the proxy was told of.
    let _: () = redis::cmd("FLUSHALL").query_async(&mut conn).await.unwrap();
    let g = store.lease("a", &[rated("w")], 10_000).await.unwrap()[0];
    assert_eq!(g.remaining, 75);
    // The bucket as it was before that call: full, and no record of the caller.
    let mut bucket = StoredBucket::get(&mut conn, "{tg:lim:w}:b").await;
    bucket.tokens = 100_000_000.0;
    bucket.holders.retain(|(name, _)| name != b"a");
    bucket.set(&mut conn, "{tg:lim:w}:b").await;
    let g = store
        .lease("a", &[known("w", 50, 75)], 10_000)
        .await
        .unwrap()[0];
    // More than the evidence allows: emptied but for the newcomers' reserve; the caller, a
    // holder of before, takes the rate it asks for.
    assert_eq!((g.granted, g.remaining, g.rate), (0, 0, 50.0), "{g:?}");
}

#[tokio::test]
async fn auto_cold_start_of_slots_grants_at_once_unless_holdings_were_lost() {
    let ttl = 10_000;
    let auto = || ColdStart::Auto {
        epoch_ms: tollgate_quota::store::now_ms(),
    };
    let redis = Redis::start();
    let on_redis = Store::Redis(
        RedisStore::connect(&single(&redis), Duration::from_millis(200), auto())
            .await
            .unwrap(),
    );
    let client = redis::Client::open(redis.url()).unwrap();
    let mut conn = client.get_multiplexed_async_connection().await.unwrap();
    let first = Store::Memory(MemoryStore::new(100, auto()));
    let restarted = Store::Memory(MemoryStore::new(100, auto()));
    for (before, after) in [(&first, &restarted), (&on_redis, &on_redis)] {
        // A new deployment: slots at once.
        assert_eq!(held(before, "a", slot("k", 6, 0), ttl).await.held, 6);
        let _: () = redis::cmd("FLUSHALL").query_async(&mut conn).await.unwrap();
        // After the loss the holder renews with its evidence: it gets back what it held (6, not
        // only the 2 it has in flight), and from then on nothing new is granted for a term.
        let holder = PermitItem {
            known_held: 6,
            ..slot("k", 6, 2)
        };
        assert_eq!(held(after, "a", holder.clone(), ttl).await.held, 6);
        // Renewing again with fewer in flight, it keeps its holding.
        let again = PermitItem {
            known_held: 6,
            ..slot("k", 6, 1)
        };
        assert_eq!(held(after, "a", again, ttl).await.held, 6);
        let newcomer = held(after, "new", slot("k", 10, 0), ttl).await;
        assert_eq!((newcomer.held, newcomer.free), (0, 4));
    }
}

#[tokio::test]
async fn after_a_restart_holders_get_back_what_they_keep_and_nothing_new_for_one_term() {
    let ttl = 10_000;
    let memory = Store::Memory(MemoryStore::new(
        100,
        ColdStart::Conservative {
            epoch_ms: tollgate_quota::store::now_ms(),
        },
    ));
    let redis = Redis::start();
    let store = Store::Redis(
        RedisStore::connect(&single(&redis), Duration::from_millis(200), CONSERVATIVE)
            .await
            .unwrap(),
    );
    for store in [&memory, &store] {
        assert_eq!(held(store, "a", slot("k", 10, 6), ttl).await.held, 6);
        let newcomer = held(store, "new", slot("k", 10, 0), ttl).await;
        assert_eq!((newcomer.held, newcomer.free), (0, 4));
        assert_eq!(held(store, "b", slot("k", 10, 7), ttl).await.held, 4);
    }
}

#[tokio::test]
async fn a_redis_clock_stepped_back_refills_from_then_in_both_stores() {
    // 1 a millisecond, burst 10: emptied, then the bucket reads as updated 10 minutes from now
    // (what Redis's clock stepping back 10 minutes does). 50 ms later it has refilled.
    let fast = LeaseItem {
        requests: 1_000,
        per_ms: 1_000,
        burst: 10,
        wanted: 10,
        ..item("k", 10, 10)
    };
    let redis = Redis::start();
    let store = Store::Redis(
        RedisStore::connect(&single(&redis), Duration::from_millis(200), ColdStart::Full)
            .await
            .unwrap(),
    );
    assert_eq!(
        store
            .lease("a", std::slice::from_ref(&fast), 10_000)
            .await
            .unwrap()[0]
            .granted,
        10
    );
    let client = redis::Client::open(redis.url()).unwrap();
    let mut conn = client.get_multiplexed_async_connection().await.unwrap();
    let keys: Vec<String> = redis::cmd("KEYS")
        .arg("*:b")
        .query_async(&mut conn)
        .await
        .unwrap();
    assert_eq!(keys.len(), 1, "{keys:?}");
    let ahead = tollgate_quota::store::now_ms() + 600_000;
    let mut bucket = StoredBucket::get(&mut conn, &keys[0]).await;
    bucket.updated = ahead as f64;
    bucket.set(&mut conn, &keys[0]).await;
    store
        .lease(
            "a",
            &[LeaseItem {
                wanted: 0,
                ..fast.clone()
            }],
            10_000,
        )
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(50)).await;
    let granted = store.lease("a", &[fast], 10_000).await.unwrap()[0].granted;
    assert_eq!(granted, 10, "before: nothing for ten minutes");
}

#[tokio::test]
async fn a_redis_clock_stepped_back_keeps_holdings_and_reservations_one_term_at_most() {
    // What Redis's clock stepping back an hour does: a holder's end lies an hour and a term
    // ahead. The holder then stops calling: its slots (and its share of the refill rate) are
    // the others' again a term after the next call, not an hour later.
    let ttl = 300;
    let redis = Redis::start();
    let store = Store::Redis(
        RedisStore::connect(&single(&redis), Duration::from_millis(200), ColdStart::Full)
            .await
            .unwrap(),
    );
    assert_eq!(held(&store, "a", slot("k", 10, 0), ttl).await.held, 10);
    let rated = LeaseItem {
        requests: 1_000,
        per_ms: 1_000,
        burst: 10,
        wanted: 10,
        demand: 1_000.0,
        ..item("r", 10, 10)
    };
    let g = store
        .lease("a", std::slice::from_ref(&rated), ttl)
        .await
        .unwrap()[0];
    // (Three quarters of it until the bucket's reserve for newcomers has filled.)
    assert_eq!((g.granted, g.rate), (10, 750.0), "the rate is a's");
    let client = redis::Client::open(redis.url()).unwrap();
    let mut conn = client.get_multiplexed_async_connection().await.unwrap();
    let hour = tollgate_quota::store::now_ms() + 3_600_000;
    let keys: Vec<String> = redis::cmd("KEYS")
        .arg("*")
        .query_async(&mut conn)
        .await
        .unwrap();
    for key in keys.iter().filter(|k| k.ends_with(":b")) {
        // A bucket's holder's `until` is its fifth number.
        let mut bucket = StoredBucket::get(&mut conn, key).await;
        for (name, fields) in &mut bucket.holders {
            if name == b"a" {
                fields[4] = hour as f64;
            }
        }
        bucket.set(&mut conn, key).await;
    }
    for key in keys.iter().filter(|k| k.ends_with(":s")) {
        let value: String = redis::cmd("HGET")
            .arg(key)
            .arg("@a")
            .query_async(&mut conn)
            .await
            .unwrap();
        // The last number is the end: "held:wanted:expires".
        let (rest, _) = value.rsplit_once(':').unwrap();
        let _: () = redis::cmd("HSET")
            .arg(key)
            .arg("@a")
            .arg(format!("{rest}:{hour}"))
            .query_async(&mut conn)
            .await
            .unwrap();
    }
    let b_rated = LeaseItem {
        demand: 0.0,
        ..rated.clone()
    };
    // b's calls now cut a's ends to a term from now…
    assert_eq!(held(&store, "b", slot("k", 5, 0), ttl).await.held, 0);
    store
        .lease("b", std::slice::from_ref(&b_rated), ttl)
        .await
        .unwrap();
    // (Sooner than the slots' hash expires unused, two terms after its last call.)
    tokio::time::sleep(Duration::from_millis(ttl + 100)).await;
    // …after which they are b's (before: nothing for an hour).
    assert_eq!(held(&store, "b", slot("k", 5, 0), ttl).await.held, 5);
    let g = store.lease("b", &[b_rated], ttl).await.unwrap()[0];
    assert_eq!(
        g.granted, 10,
        "the bucket refilled once a's reservation ended: {g:?}"
    );
}

/// A memory store and a Redis store on `redis`, both with the automatic cold start.
async fn auto_stores(redis: &Redis) -> [Store; 2] {
    let auto = || ColdStart::Auto {
        epoch_ms: tollgate_quota::store::now_ms(),
    };
    [
        Store::Memory(MemoryStore::new(100, auto())),
        Store::Redis(
            RedisStore::connect(&single(redis), Duration::from_millis(200), auto())
                .await
                .unwrap(),
        ),
    ]
}

/// Tokens given back after a proxy's evidence can leave a bucket fuller than that evidence
/// allows: the store that has served the proxy since lost nothing, and serves it as usual (both
/// stores).
#[tokio::test]
async fn give_backs_beyond_a_served_proxys_evidence_are_no_loss() {
    let redis = Redis::start();
    let stores = auto_stores(&redis).await;
    for store in &stores {
        let ttl = 10_000;
        let take = |n| LeaseItem {
            wanted: n,
            ..item("g", 100, n)
        };
        assert_eq!(
            store.lease("a", &[take(50)], ttl).await.unwrap()[0].granted,
            50
        );
        let g = store.lease("b", &[take(50)], ttl).await.unwrap()[0];
        assert_eq!((g.granted, g.remaining), (50, 0));
        // b gives 40 back: 40 in the bucket, a's evidence said 0.
        let back = LeaseItem {
            returned: 40,
            ..take(0)
        };
        assert_eq!(
            store.lease("b", &[back], ttl).await.unwrap()[0].returned,
            40
        );
        let g = store
            .lease(
                "a",
                &[LeaseItem {
                    known_ms: 5,
                    known_remaining: 0,
                    ..take(30)
                }],
                ttl,
            )
            .await
            .unwrap()[0];
        assert_eq!((g.granted, g.remaining), (30, 10), "{g:?}");
    }
}

/// A bucket made anew full by a caller without evidence, then evidence old enough to allow what
/// it holds (70 + 12 + 1 + 100/s × 0.9 s > 71): the store has no record of serving that caller
/// within a term, so it lost the bucket all the same, and empties it (both stores): what the
/// first caller got is all a loss added.
#[tokio::test]
async fn old_evidence_still_shows_a_bucket_made_anew() {
    let redis = Redis::start();
    let stores = auto_stores(&redis).await;
    for store in &stores {
        let g = store.lease("new", &[rated("anew")], 10_000).await.unwrap()[0];
        assert_eq!((g.granted, g.remaining), (25, 75), "no evidence: full");
        let g = store
            .lease(
                "new",
                &[LeaseItem {
                    wanted: 4,
                    ..rated("anew")
                }],
                10_000,
            )
            .await
            .unwrap()[0];
        assert_eq!(g.remaining, 71);
        let g = store
            .lease("old", &[known("anew", 900, 70)], 10_000)
            .await
            .unwrap()[0];
        assert_eq!((g.granted, g.remaining, g.rate), (0, 0, 50.0), "{g:?}");
    }
}

#[tokio::test]
async fn a_redis_that_paused_is_not_taken_for_one_that_lost_writes() {
    // A takes 60 of 100 (20/s) and calls again with its evidence (40 left) while Redis is
    // paused for a second: the call gives up (503), and its run executes when Redis resumes,
    // a second later than the evidence says. The bucket refilled meanwhile: more than the
    // evidence allowed at the time it gives, but not at the time the run executed — no loss.
    // (Before, the bucket was taken for one that lost writes: emptied to its reserve and the
    // rate held for a lease term: everyone refused for ~10 s.)
    let redis = Redis::start();
    let store = Store::Redis(
        RedisStore::connect(
            &single(&redis),
            Duration::from_millis(100),
            ColdStart::Auto {
                epoch_ms: tollgate_quota::store::now_ms(),
            },
        )
        .await
        .unwrap(),
    );
    let limit = |wanted: u64| LeaseItem {
        requests: 20,
        per_ms: 1_000,
        ..item("paused", 100, wanted)
    };
    let g = store.lease("a", &[limit(60)], 10_000).await.unwrap()[0];
    assert_eq!((g.granted, g.remaining), (60, 40));
    stop_process(redis.pid());
    let evidence = LeaseItem {
        known_ms: 1,
        known_remaining: 40,
        ..limit(0)
    };
    assert!(store.lease("a", &[evidence], 10_000).await.is_err());
    tokio::time::sleep(Duration::from_secs(1)).await;
    resume_process(redis.pid());
    // (The late run executes first: Redis serves its connection's commands in order.)
    let g = store.lease("b", &[limit(0)], 10_000).await.unwrap()[0];
    assert!(
        g.remaining >= 55,
        "the bucket kept its tokens and refilled: {g:?}"
    );
}
