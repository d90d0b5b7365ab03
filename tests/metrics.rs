//! The Prometheus endpoint (issue 5 item 6: per-stage latency histograms) and the
//! auto-delete exchange lifecycle, through lapin.

mod common;

use std::io::{Read, Write};

use common::*;
use lapin::options::*;
use lapin::types::FieldTable;
use lapin::ExchangeKind;

fn scrape(port: u16) -> String {
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).expect("metrics port");
    s.set_read_timeout(Some(std::time::Duration::from_secs(5))).unwrap();
    s.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n").unwrap();
    let mut out = String::new();
    let _ = s.read_to_string(&mut out);
    out
}

fn value(text: &str, series: &str) -> f64 {
    text.lines()
        .find_map(|l| l.strip_prefix(series).and_then(|rest| rest.trim().parse().ok()))
        .unwrap_or_else(|| panic!("no series {series} in:\n{text}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_count_messages_and_stage_latencies() {
    let b = Broker::start();
    require_own_broker!(b, "reads ringmq's metrics endpoint");
    let (c, ch) = connect_ch(&b).await;
    let q = plain_queue(&ch, "metrics").await;
    confirm_mode(&ch).await;
    for i in 0..64u8 {
        assert!(publish_confirmed(&ch, "", &q, &[i], Default::default()).await.is_ack());
    }
    let mut cons = t("consume", ch.basic_consume(q.as_str().into(), "".into(), Default::default(), FieldTable::default())).await.unwrap();
    for _ in 0..64 {
        let d = next_delivery(&mut cons, std::time::Duration::from_secs(5)).await;
        t("ack", d.ack(Default::default())).await.unwrap();
    }
    // a round trip so the acks are processed
    t("qos", ch.basic_qos(1, Default::default())).await.unwrap();
    let port = b.metrics_port();
    let text = tokio::task::spawn_blocking(move || scrape(port)).await.unwrap();
    assert!(text.starts_with("HTTP/1.1 200"), "{text}");
    assert!(value(&text, "ringmq_messages_published_total") >= 64.0);
    assert!(value(&text, "ringmq_messages_delivered_total") >= 64.0);
    assert!(value(&text, "ringmq_messages_acked_total") >= 64.0);
    assert!(value(&text, "ringmq_messages_confirmed_total") >= 64.0);
    // publish→stored and stored→delivered are sampled (one message in 16); every ack counts
    for (stage, least) in [("publish_to_stored", 2.0), ("stored_to_delivered", 2.0), ("delivered_to_acked", 64.0)] {
        let n = value(&text, &format!("ringmq_stage_latency_seconds_count{{stage=\"{stage}\"}}"));
        assert!(n >= least, "stage {stage}: {n} samples");
        let inf = value(&text, &format!("ringmq_stage_latency_seconds_bucket{{le=\"+Inf\",stage=\"{stage}\"}}"));
        assert_eq!(inf, n, "+Inf bucket equals the count");
    }
    assert_eq!(value(&text, "ringmq_raft_is_leader"), 1.0);
    t("close", c.close(200, "".into())).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn auto_delete_exchange_goes_with_its_last_binding() {
    let b = Broker::start();
    let (c, ch) = connect_ch(&b).await;
    let x = uniq("adx");
    let opts = ExchangeDeclareOptions { auto_delete: true, ..Default::default() };
    t("declare x", ch.exchange_declare(x.as_str().into(), ExchangeKind::Fanout, opts, FieldTable::default())).await.unwrap();
    let q = plain_queue(&ch, "adq").await;
    t("bind", ch.queue_bind(q.as_str().into(), x.as_str().into(), "".into(), Default::default(), FieldTable::default())).await.unwrap();
    assert!(exchange_exists(&c, &x).await, "auto-delete exchange with a binding exists");
    t("unbind", ch.queue_unbind(q.as_str().into(), x.as_str().into(), "".into(), FieldTable::default())).await.unwrap();
    assert!(!exchange_exists(&c, &x).await, "auto-delete exchange deleted with its last binding");
    t("close", c.close(200, "".into())).await.unwrap();
}
