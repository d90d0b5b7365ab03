//! The stages of a message's way through the broker that the latency histograms measure
//! (`ringmq_stage_latency_seconds{stage}`, `ringmq_queue_stage_latency_seconds`, the
//! management UI's latency view), what each one means, and where it starts and ends.
//!
//! The stages are not one pipeline. From the end of basic.publish three run side by side:
//! the message becomes ready in its queue (`publish_to_enqueued`), becomes safe on disk or
//! in a majority (`publish_to_stored`, persistent messages in durable queues and replicated
//! queues only: a consumer may get the message before it is stored, RabbitMQ's order too),
//! and its confirm goes out (`publish_to_confirmed`, after both). Then the message waits for
//! a consumer (`enqueued_to_taken`: the consumers' capacity, not the broker's speed), is
//! written to the consumer's socket (`taken_to_written`), and is acknowledged
//! (`written_to_acked`: the client's time, network included). `taken_to_acked` is that last
//! round trip as its queue sees it, so that one queue's consumers can be looked at.
//!
//! Sampling: the publish side follows one message in [`SAMPLE_EVERY`] per core, chosen at
//! basic.publish; the delivery side one delivery in [`SAMPLE_EVERY`] per core, chosen when
//! the queue takes it for a consumer; each such point counts on its own ([`SamplePoint`]).
//! Only those read the clock; every stage counts only its sampled messages (a histogram's
//! count is about 1/16 of the messages).

use std::time::Duration;

use super::{Histogram, HistogramCounts};

/// One stage ([`STAGES`] describes each).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Stage {
    /// End of basic.publish → ready in its queue.
    PublishToEnqueued,
    /// End of basic.publish → stored for good (synced, or committed by a majority).
    PublishToStored,
    /// End of basic.publish → its basic.ack or basic.nack encoded for the publisher.
    PublishToConfirmed,
    /// Ready in its queue → taken for a consumer or a basic.get (first deliveries).
    EnqueuedToTaken,
    /// Taken → its frames in the consumer connection's next socket write.
    TakenToWritten,
    /// Written to the consumer → its basic.ack read (manual ack only).
    WrittenToAcked,
    /// Taken → its acknowledgement back at the queue (manual ack only).
    TakenToAcked,
}

/// Number of stages.
pub const STAGE_COUNT: usize = 7;

/// Whose time a stage is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Side {
    /// The broker's own work.
    Broker,
    /// Waiting in a queue for a consumer with credit: set by the consumers' capacity.
    Queue,
    /// The client's (and the network's) time.
    Client,
    /// Broker and client together.
    RoundTrip,
}

impl Side {
    /// The name the management API gives it.
    pub fn name(self) -> &'static str {
        match self {
            Side::Broker => "broker",
            Side::Queue => "queue",
            Side::Client => "client",
            Side::RoundTrip => "round_trip",
        }
    }
}

/// What one stage measures.
#[derive(Debug)]
pub struct StageInfo {
    /// The stage.
    pub stage: Stage,
    /// Its label in the metrics and its key in the management API.
    pub name: &'static str,
    /// Whose time it is.
    pub side: Side,
    /// Measured per queue too (else per node only: a connection measures it, and a
    /// connection's messages come from any queue).
    pub per_queue: bool,
    /// Where it starts and ends, for people (the UI shows it beside the plot).
    pub meaning: &'static str,
}

/// Every stage, in the order a message meets them.
pub const STAGES: [StageInfo; STAGE_COUNT] = [
    StageInfo {
        stage: Stage::PublishToEnqueued,
        name: "publish_to_enqueued",
        side: Side::Broker,
        per_queue: true,
        meaning: "From the end of basic.publish (its last frame read) to the message being ready in its queue: \
                  routed, handed to the queue's core, appended. In a replicated queue, committed by the group.",
    },
    StageInfo {
        stage: Stage::PublishToStored,
        name: "publish_to_stored",
        side: Side::Broker,
        per_queue: true,
        meaning: "From the end of basic.publish to the message being stored for good: synced to disk (a persistent \
                  message in a durable queue) or committed by a majority (a replicated queue). Other messages \
                  have no such step. Runs beside delivery: a consumer may get the message before it is stored.",
    },
    StageInfo {
        stage: Stage::PublishToConfirmed,
        name: "publish_to_confirmed",
        side: Side::Broker,
        per_queue: false,
        meaning: "From the end of basic.publish to its basic.ack (or nack) going out on the publisher's connection \
                  (channels in confirm mode): what a publisher waits for, less the network.",
    },
    StageInfo {
        stage: Stage::EnqueuedToTaken,
        name: "enqueued_to_taken",
        side: Side::Queue,
        per_queue: true,
        meaning: "From ready in the queue to taken for a consumer or a basic.get (first deliveries only): time \
                  spent waiting for a consumer with credit. It grows when consumers are few or slow.",
    },
    StageInfo {
        stage: Stage::TakenToWritten,
        name: "taken_to_written",
        side: Side::Broker,
        per_queue: false,
        meaning: "From taken for a consumer to its frames going out in the consumer connection's next socket write: \
                  the hop to the connection's core (or node) and its write batch. For a queue on another node, \
                  from the delivery's arrival on the consumer's node.",
    },
    StageInfo {
        stage: Stage::WrittenToAcked,
        name: "written_to_acked",
        side: Side::Client,
        per_queue: false,
        meaning: "From the delivery written to the consumer's socket to its basic.ack read (manual ack only): the \
                  consumer's processing and the network both ways, and any wait for a client that does not read.",
    },
    StageInfo {
        stage: Stage::TakenToAcked,
        name: "taken_to_acked",
        side: Side::RoundTrip,
        per_queue: true,
        meaning: "From taken for a consumer to its acknowledgement back at the queue (manual ack only): \
                  taken_to_written and written_to_acked together, plus the hops back, as one queue sees them.",
    },
];

/// One histogram per stage, in [`STAGES`] order. Relaxed atomics: recorded on one core,
/// read on scrape or by the management API.
#[derive(Debug, Default)]
pub struct Stages([Histogram; STAGE_COUNT]);

impl Stages {
    /// Records one sampled message's time in `stage`.
    pub fn record(&self, stage: Stage, d: Duration) {
        self.0[stage as usize].record(d);
    }

    /// The counts of each stage, in [`STAGES`] order.
    pub fn counts(&self) -> [HistogramCounts; STAGE_COUNT] {
        std::array::from_fn(|i| self.0[i].counts())
    }
}

/// Where a message is picked to be followed. Each point counts on its own, so that points one
/// core passes in lockstep cannot alias: with one delivery counter, a basic.get whose queue
/// and connection share a core advanced it twice per message, at the take and at the get-ok,
/// and every 16th count fell on the get-ok, so the queue never sampled a get.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SamplePoint {
    /// basic.publish on a client's connection (the publish side).
    Publish,
    /// A dead-lettered copy republished by its queue.
    DeadLetter,
    /// A queue takes a message for a consumer or a basic.get (`taken_to_acked`,
    /// `taken_to_written`).
    Take,
    /// A connection receives a delivery or a get-ok it did not take itself: a get-ok's
    /// `written_to_acked`, a delivery from another node's queue.
    Hand,
}

thread_local! {
    static COUNTS: [std::cell::Cell<u32>; 4] = const { [const { std::cell::Cell::new(0) }; 4] };
}

/// Whether the message (or delivery) at `point` is followed: one in [`SAMPLE_EVERY`] per
/// thread and point, so the hot path reads the clock for few.
pub fn sample_at(point: SamplePoint) -> bool {
    COUNTS.with(|c| {
        let n = &c[point as usize];
        let v = n.get().wrapping_add(1);
        n.set(v);
        v % SAMPLE_EVERY == 0
    })
}

/// Whether this published message is followed through its stages ([`SamplePoint::Publish`]).
pub fn sample() -> bool {
    sample_at(SamplePoint::Publish)
}

/// Whether the delivery a queue takes now is followed ([`SamplePoint::Take`]).
pub fn sample_delivery() -> bool {
    sample_at(SamplePoint::Take)
}

/// One message (and one delivery) in this many is sampled, per core.
pub const SAMPLE_EVERY: u32 = 16;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_stage_is_listed_once_at_its_own_index() {
        for (i, s) in STAGES.iter().enumerate() {
            assert_eq!(s.stage as usize, i, "{}", s.name);
        }
        let st = Stages::default();
        st.record(Stage::WrittenToAcked, Duration::from_micros(3));
        let c = st.counts();
        assert_eq!(c[Stage::WrittenToAcked as usize].count, 1);
        assert_eq!(c.iter().map(|h| h.count).sum::<u64>(), 1);
    }

    #[test]
    fn one_in_sample_every_is_sampled_at_each_point_whatever_passes_the_others() {
        // A core that receives publishes, takes for a basic.get and writes its get-ok, in
        // lockstep: each point samples one in SAMPLE_EVERY of its own.
        let (mut p, mut t, mut h) = (0, 0, 0);
        for _ in 0..SAMPLE_EVERY * 10 {
            p += sample() as u32;
            t += sample_delivery() as u32;
            h += sample_at(SamplePoint::Hand) as u32;
        }
        assert_eq!((p, t, h), (10, 10, 10));
    }
}
