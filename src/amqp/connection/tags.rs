//! Delivery-tag assignment for basic.deliver, done by the writer as it encodes a delivery
//! (pure: no I/O, no executor).
//!
//! AMQP 0-9-1 spec 1.8.3.9 (basic.deliver) and the `delivery-tag` domain: tags are
//! channel-specific, never 0, and the client acknowledges with them (1.8.3.13 basic.ack,
//! `multiple` = "up to and including"), so they must only grow on a channel.
//!
//! Invariants:
//! - Tags come from the channel's own counter ([`Channel::take_tag`], which basic.get
//!   shares): the first is 1, each next one is one more, per channel.
//! - A delivery for another incarnation of the channel number (a stale `chan_uid`), or for
//!   a channel that is closing or gone, takes no tag and records nothing: its queue
//!   requeues it when the channel's `ChannelClosed` arrives.
//! - A tracked delivery (manual ack) is recorded in the channel's ledger under its tag.

use rustc_hash::FxHashMap;

use crate::amqp::channel::{Channel, ChannelState};
use crate::amqp::unacked::{DeliveryTag, Unacked};

/// Assigns the delivery tag of one basic.deliver for channel number `channel` of
/// incarnation `chan_uid`, and records `unacked` (a manual-ack delivery) in its ledger.
///
/// Returns `None`, changing nothing, when the channel is gone, closing, or another
/// incarnation of that number.
pub fn assign_delivery_tag(
    channels: &mut FxHashMap<u16, Channel>,
    channel: u16,
    chan_uid: u64,
    unacked: Option<Unacked>,
) -> Option<DeliveryTag> {
    let c = channels.get_mut(&channel).filter(|c| c.uid == chan_uid && c.state == ChannelState::Open)?;
    let tag = c.take_tag();
    if let Some(u) = unacked {
        c.ledger.insert(tag, u);
    }
    Some(tag)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::broker::{Offset, QueueKey, QueueRef};
    use proptest::prelude::*;

    fn u(off: u64) -> Unacked {
        Unacked {
            queue: QueueRef { key: QueueKey::new("/", "q"), owner_core: 0, owner_node: 1, durable: false },
            offset: Offset(off),
            written: None,
        }
    }

    fn open(ids: &[(u16, u64)]) -> FxHashMap<u16, Channel> {
        ids.iter().map(|&(id, uid)| (id, Channel::new(id, uid))).collect()
    }

    #[test]
    fn tags_start_at_one_and_grow_per_channel() {
        let mut chs = open(&[(1, 10), (2, 20)]);
        assert_eq!(assign_delivery_tag(&mut chs, 1, 10, None), Some(DeliveryTag(1)));
        assert_eq!(assign_delivery_tag(&mut chs, 1, 10, None), Some(DeliveryTag(2)));
        assert_eq!(assign_delivery_tag(&mut chs, 2, 20, None), Some(DeliveryTag(1)));
        assert_eq!(assign_delivery_tag(&mut chs, 1, 10, None), Some(DeliveryTag(3)));
        assert_eq!(assign_delivery_tag(&mut chs, 2, 20, None), Some(DeliveryTag(2)));
    }

    #[test]
    fn basic_get_and_deliver_share_the_counter() {
        let mut chs = open(&[(1, 10)]);
        assert_eq!(assign_delivery_tag(&mut chs, 1, 10, None), Some(DeliveryTag(1)));
        assert_eq!(chs.get_mut(&1).unwrap().take_tag(), DeliveryTag(2));
        assert_eq!(assign_delivery_tag(&mut chs, 1, 10, None), Some(DeliveryTag(3)));
    }

    #[test]
    fn stale_closing_or_missing_channel_takes_no_tag() {
        let mut chs = open(&[(1, 10)]);
        // another incarnation of channel 1
        assert_eq!(assign_delivery_tag(&mut chs, 1, 9, Some(u(5))), None);
        // no channel 3
        assert_eq!(assign_delivery_tag(&mut chs, 3, 10, Some(u(5))), None);
        assert!(chs[&1].ledger.is_empty());
        assert_eq!(assign_delivery_tag(&mut chs, 1, 10, None), Some(DeliveryTag(1)));
        chs.get_mut(&1).unwrap().state = ChannelState::Closing;
        assert_eq!(assign_delivery_tag(&mut chs, 1, 10, Some(u(6))), None);
        assert!(chs[&1].ledger.is_empty());
        assert_eq!(chs[&1].next_tag, 2);
    }

    #[test]
    fn reopened_channel_starts_again_at_one() {
        let mut chs = open(&[(1, 10)]);
        assert_eq!(assign_delivery_tag(&mut chs, 1, 10, None), Some(DeliveryTag(1)));
        assert_eq!(assign_delivery_tag(&mut chs, 1, 10, None), Some(DeliveryTag(2)));
        chs.insert(1, Channel::new(1, 11));
        assert_eq!(assign_delivery_tag(&mut chs, 1, 10, None), None);
        assert_eq!(assign_delivery_tag(&mut chs, 1, 11, None), Some(DeliveryTag(1)));
    }

    #[test]
    fn tracked_deliveries_land_in_the_ledger_under_their_tag() {
        let mut chs = open(&[(1, 10)]);
        assert_eq!(assign_delivery_tag(&mut chs, 1, 10, Some(u(100))), Some(DeliveryTag(1)));
        assert_eq!(assign_delivery_tag(&mut chs, 1, 10, None), Some(DeliveryTag(2)));
        assert_eq!(assign_delivery_tag(&mut chs, 1, 10, Some(u(300))), Some(DeliveryTag(3)));
        let l = &mut chs.get_mut(&1).unwrap().ledger;
        assert_eq!(l.len(), 2);
        assert_eq!(l.settle(DeliveryTag(2), false).unwrap_err().code, 406);
        assert_eq!(l.settle(DeliveryTag(3), true).unwrap().iter().map(|x| x.offset.0).collect::<Vec<_>>(), vec![100, 300]);
    }

    proptest! {
        /// Whatever mix of deliveries (current or stale incarnation, tracked or not) reaches
        /// three channels, each channel's tags are 1, 2, 3, … in the order assigned, stale
        /// ones take none, and the ledger holds exactly the tracked tags.
        #[test]
        fn tags_strictly_increase_per_channel(ops in proptest::collection::vec((1u16..4, any::<bool>(), any::<bool>()), 0..200)) {
            let mut chs = open(&[(1, 100), (2, 200), (3, 300)]);
            let mut seen: FxHashMap<u16, Vec<u64>> = FxHashMap::default();
            let mut tracked: FxHashMap<u16, Vec<u64>> = FxHashMap::default();
            for (i, (ch, current, track)) in ops.into_iter().enumerate() {
                let uid = if current { ch as u64 * 100 } else { ch as u64 * 100 + 1 };
                let r = assign_delivery_tag(&mut chs, ch, uid, track.then(|| u(i as u64)));
                if !current {
                    prop_assert_eq!(r, None);
                    continue;
                }
                let tag = r.expect("current incarnation, open");
                let v = seen.entry(ch).or_default();
                prop_assert_eq!(tag.0, v.last().map_or(1, |t| t + 1));
                v.push(tag.0);
                if track {
                    tracked.entry(ch).or_default().push(tag.0);
                }
            }
            for ch in 1u16..4 {
                let c = chs.get_mut(&ch).unwrap();
                let want = tracked.remove(&ch).unwrap_or_default();
                prop_assert_eq!(c.ledger.len(), want.len());
                for t in want {
                    prop_assert!(c.ledger.settle(DeliveryTag(t), false).is_ok());
                }
            }
        }
    }
}
