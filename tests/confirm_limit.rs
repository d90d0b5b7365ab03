//! Every confirm-mode publish is answered within its limit, whatever became of it (issue 40
//! item 3): a publish whose queue never answers is nacked by its connection after
//! `CONFIRM_LIMIT` (30 s), once, and the channel goes on confirming the others.
//!
//! The queue that never answers is a fault injected into the debug build
//! (`RINGMQ_FAILPOINT_UNANSWERED_QUEUE`, `core::failpoint`): it stores what is published to
//! it and drops its confirm tickets, as a server that lost track of a publish would. Before
//! the limit such a publisher waited for ever (pika's `basic_publish` in confirm mode blocks).

mod common;

use std::time::{Duration, Instant};

use common::*;
use lapin::options::{BasicGetOptions, BasicPublishOptions, ConfirmSelectOptions, QueueDeclareOptions};
use lapin::BasicProperties;

/// The queue name the failpoint silences (one test per process: the variable is read once).
const SILENT: &str = "ringmq-test.confirm-limit.silent";

/// basic.publish of `body` to `queue` through the default exchange; the confirm to wait for.
async fn publish_to(ch: &lapin::Channel, queue: &str, body: &'static [u8]) -> lapin::PublisherConfirm {
    ch.basic_publish("".into(), queue.into(), BasicPublishOptions::default(), body, BasicProperties::default())
        .await
        .expect("basic.publish")
}

#[tokio::test]
async fn a_publish_its_queue_never_answers_is_nacked_after_the_limit_and_the_channel_goes_on() {
    // Read by the broker this test starts (the only one in this test binary).
    std::env::set_var("RINGMQ_FAILPOINT_UNANSWERED_QUEUE", SILENT);
    let b = Broker::start();
    let (_conn, ch) = connect_ch(&b).await;
    t("confirm.select", ch.confirm_select(ConfirmSelectOptions::default())).await.expect("confirm.select");
    let silent = declare_queue(&ch, SILENT, QueueDeclareOptions::default(), Default::default()).await;
    let answered = declare_queue(&ch, &uniq("answered"), QueueDeclareOptions::default(), Default::default()).await;

    let started = Instant::now();
    let mut silent_confirms = Vec::new();
    for body in [&b"one"[..], b"two", b"three"] {
        silent_confirms.push(publish_to(&ch, &silent, body).await);
    }
    // A later publish to a queue that answers is confirmed at once, single (the earlier ones
    // still wait): nothing holds it back.
    let later = tt("confirm of a later publish", Duration::from_secs(10), publish_to(&ch, &answered, b"later").await).await;
    assert!(later.expect("confirm").is_ack(), "a publish to a queue that answers was not confirmed");
    assert!(started.elapsed() < Duration::from_secs(10));

    for pc in silent_confirms {
        let c = tt("the silent queue's publish answered by the limit", Duration::from_secs(45), pc).await.expect("confirm");
        assert!(c.is_nack(), "a publish nobody answered was confirmed: {c:?}");
    }
    let waited = started.elapsed();
    assert!(
        (Duration::from_secs(29)..Duration::from_secs(40)).contains(&waited),
        "nacked after {waited:?}, not about CONFIRM_LIMIT (30 s) after the publish"
    );

    // The channel is fine and confirms on: no second answer for the given-up publishes.
    let after = tt("confirm after the nacks", Duration::from_secs(10), publish_to(&ch, &answered, b"after").await).await;
    assert!(after.expect("confirm").is_ack(), "the channel stopped confirming after giving publishes up");

    // A nack means "not known to be stored": this queue did store them.
    let mut stored = 0;
    while let Some(m) = t("basic.get", ch.basic_get(silent.as_str().into(), BasicGetOptions { no_ack: true })).await.expect("basic.get") {
        assert!([&b"one"[..], b"two", b"three"].contains(&m.delivery.data.as_slice()));
        stored += 1;
    }
    assert_eq!(stored, 3, "the silent queue stored its publishes");

    let text = common::http::http_get(b.metrics_port(), "/metrics").expect("metrics");
    assert_eq!(metric_value(&text, "ringmq_confirms_given_up_total"), Some(3.0), "{text}");
    assert!(b.log().contains("publishes unanswered for 30 s: nacked"), "no log line says why:\n{}", b.log());
}
