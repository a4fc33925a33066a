//! The KV-event subscriber over real ZMQ sockets: kvroute-sim publishing vLLM's events, and
//! PUB and replay (ROUTER) sockets driven by the test. Nothing sleeps to synchronise: a
//! subscription is known to be live once a probe published after it arrives, and every wait
//! has a deadline.

#[path = "kv_events/harness.rs"]
mod harness;

use std::time::Duration;

use bytes::Bytes;
use harness::*;
use kvroute_index::StorageTier;
use kvroute_protocol::kv_events::encode_seq;
use serde_json::json;
use zeromq::Socket;

#[tokio::test]
async fn kvroute_sim_events_reach_the_sink() {
    let sim = Sim::start("2").await;
    let sub = Running::start(config(sim.port, None, 2));
    // Each rank's subscription is live once a request sent to that rank stores a block.
    for rank in 0..2 {
        let is_stored = |c: &Call| matches!(c, Call::Stored { rank: r, .. } if *r == rank);
        let mut probe = 0;
        loop {
            probe += 1;
            assert!(probe < 200, "no event from rank {rank}");
            let body = json!({"prompt": prompt(20, probe), "max_tokens": 1});
            assert_eq!(sim.post("/v1/completions", rank, body).await, 200);
            let limit = Duration::from_millis(100);
            let found = sub
                .sink
                .find(limit, |c| c.iter().find(|c| is_stored(c)).cloned());
            if found.await.is_some() {
                break;
            }
        }
    }
    assert_eq!(sim.post("/reset_prefix_cache", 0, json!({})).await, 200);
    let both = |c: &[Call]| c.contains(&Call::Cleared(0)) && c.contains(&Call::Cleared(1));
    sub.sink
        .wait("AllBlocksCleared from both ranks", both)
        .await;
    sub.sink.take();

    // 50 tokens: three full blocks of 16, stored on rank 1 with the prompt's bytes as tokens.
    let text = prompt(50, 3);
    let body = json!({"prompt": text, "max_tokens": 1});
    assert_eq!(sim.post("/v1/completions", 1, body).await, 200);
    let calls = sub
        .sink
        .wait("the prompt's blocks", |c| !c.is_empty())
        .await;
    let Call::Stored {
        rank,
        parent,
        hashes,
        tokens,
        block_size,
        tier,
        salt,
    } = &calls[0]
    else {
        panic!("{calls:?}");
    };
    let expected: Vec<u32> = text.bytes().take(48).map(u32::from).collect();
    assert_eq!(
        (*rank, *parent, hashes.len(), *block_size),
        (1, None, 3, 16)
    );
    assert_eq!((tokens, *tier, *salt), (&expected, StorageTier::Device, 0));
    // A prompt sharing those 48 tokens stores one more block, chained to the third.
    let longer = format!("{}{}", &text[..48], prompt(20, 9));
    let body = json!({"prompt": longer, "max_tokens": 1});
    assert_eq!(sim.post("/v1/completions", 1, body).await, 200);
    let calls = sub
        .sink
        .wait("the longer prompt's block", |c| c.len() == 2)
        .await;
    let chained = matches!(&calls[1], Call::Stored { parent: Some(p), .. } if *p == hashes[2]);
    assert!(chained, "{calls:?}");
    assert_eq!(sub.count("cleared", "ok"), 2);
    assert_eq!(
        sub.count("batch", "malformed") + sub.count("batch", "gap"),
        0
    );
    sub.stop().await;
    sim.stop().await;
}

#[tokio::test]
async fn bad_input_is_counted_and_skipped() {
    let (mut publisher, sub, seq) = connected(0, None).await;
    let seq_frame = Bytes::copy_from_slice(&encode_seq(seq));
    let good = payload(vec![]);
    publisher
        .publish(seq, Bytes::from_static(b"\xc1 not msgpack"))
        .await;
    publisher.frames(vec![Bytes::from_static(b"kv")]).await;
    publisher
        .frames(vec![Bytes::new(), seq_frame, good.clone(), good])
        .await;
    let short_seq = vec![Bytes::new(), Bytes::from_static(b"123"), payload(vec![])];
    publisher.frames(short_seq).await;
    let events = vec![
        stored(&[1], None, 12, 12),
        stored(&[2], None, 16, 15),
        stored(&[3], None, 32, 32),
    ];
    publisher.publish(seq + 1, payload(events)).await;
    let calls = sub.sink.wait("the good batch", |c| !c.is_empty()).await;
    assert_eq!(stored_hashes(&calls), [3], "{calls:?}");
    assert_eq!(sub.count("batch", "malformed"), 4);
    assert_eq!(sub.count("stored", "block_size_mismatch"), 1);
    assert_eq!(sub.count("stored", "token_count"), 1);
    assert_eq!(sub.count("stored", "ok"), 1);
    assert_eq!(
        sub.count("batch", "gap"),
        0,
        "an undecodable payload's seq still counts"
    );
    sub.stop().await;
}

#[tokio::test]
async fn gaps_and_restarts_clear_the_rank() {
    let (mut publisher, sub, seq) = connected(10, None).await;
    publisher
        .publish(seq + 2, payload(vec![stored(&[1], None, 16, 16)]))
        .await;
    let calls = sub.sink.wait("after the gap", |c| c.len() == 2).await;
    assert_eq!(calls[0], Call::Cleared(0));
    assert_eq!(stored_hashes(&calls), [1]);
    assert_eq!(sub.count("batch", "gap"), 1);
    sub.sink.take();
    // The engine restarted: seq starts again from 0.
    publisher
        .publish(0, payload(vec![stored(&[2], None, 16, 16)]))
        .await;
    publisher
        .publish(1, payload(vec![stored(&[3], Some(2), 16, 16)]))
        .await;
    let calls = sub.sink.wait("after the restart", |c| c.len() == 3).await;
    assert_eq!(calls[0], Call::Cleared(0));
    assert_eq!(stored_hashes(&calls), [2, 3]);
    let counts = (sub.count("batch", "restart"), sub.count("batch", "gap"));
    assert_eq!(counts, (1, 1));
    sub.stop().await;
}

#[tokio::test]
async fn a_gap_is_replayed_in_order_before_the_current_batch() {
    let replay = ReplayServer::start().await;
    let (mut publisher, sub, seq) = connected(0, Some(replay.port)).await;
    // seq..seq+2 are only in the replay buffer; seq+3 is published (and buffered, as vLLM does).
    for s in seq..seq + 4 {
        let batch = payload(vec![stored(&[s], None, 16, 16)]);
        replay.buffer.lock().unwrap().push((s, batch));
    }
    let current = payload(vec![stored(&[seq + 3], None, 16, 16)]);
    publisher.publish(seq + 3, current).await;
    let calls = sub
        .sink
        .wait("the replayed batches", |c| c.len() == 4)
        .await;
    assert_eq!(stored_hashes(&calls), [seq, seq + 1, seq + 2, seq + 3]);
    assert_eq!(*replay.starts.lock().unwrap(), [seq]);
    let counts = (sub.count("batch", "replayed"), sub.count("batch", "gap"));
    assert_eq!(counts, (3, 0));
    sub.sink.take();
    // seq+4 is no longer in the engine's buffer: the replay cannot cover the gap.
    replay
        .buffer
        .lock()
        .unwrap()
        .push((seq + 5, payload(vec![])));
    let current = payload(vec![stored(&[seq + 6], None, 16, 16)]);
    publisher.publish(seq + 6, current).await;
    let calls = sub.sink.wait("the cleared rank", |c| c.len() == 2).await;
    assert_eq!(calls[0], Call::Cleared(0));
    assert_eq!(stored_hashes(&calls), [seq + 6]);
    let counts = (sub.count("batch", "replayed"), sub.count("batch", "gap"));
    assert_eq!(counts, (3, 1));
    sub.stop().await;
}

#[tokio::test]
async fn a_late_or_restarted_publisher_is_reconnected() {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    // The subscriber starts first, as when the router comes up before the engine.
    let sub = Running::start(config(port, None, 1));
    let mut publisher = Publisher::bind(port).await;
    let (_, calls) = publisher.sync(&sub.sink, 1000).await;
    assert!(
        !calls.contains(&Call::Cleared(0)),
        "the first batch is the baseline"
    );
    // The engine restarts on the same port and numbers its batches from 0 again: the
    // subscriber notices the dead connection, reconnects and sees the sequence go back.
    publisher.socket.close().await;
    let mut restarted = Publisher::bind(port).await;
    let (_, calls) = restarted.sync(&sub.sink, 0).await;
    assert_eq!(calls[0], Call::Cleared(0), "{calls:?}");
    let counts = (sub.count("batch", "restart"), sub.count("batch", "gap"));
    assert_eq!(counts, (1, 0));
    sub.stop().await;
}
