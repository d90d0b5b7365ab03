//! Names that travel together as newtypes, so one cannot stand for another: a message's
//! [`Offset`] in its queue's shard, a connection's [`ConnId`], a [`ChannelId`], a consumer's
//! [`ConsumerTag`], a [`QueueName`].
//! (A channel's delivery tags are the protocol's: `amqp::unacked::DeliveryTag`.)

use std::fmt;
use std::sync::Arc;

/// A fresh id no other node or run of the cluster hands out (a queue declaration's
/// `QueueDef::incarnation`, a replica set grow's id): nonzero; a hash, under std's randomly
/// keyed hasher, of this node's id, a per-node counter `n` and the time, so two ids in the
/// cluster's life practically never match (2^-64 per pair).
pub fn cluster_unique_id(node: u64, n: u64) -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(node);
    h.write_u64(n);
    h.write_u128(std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos()));
    h.finish() | 1
}

/// A message's position in its queue's shard (`ringmq-shards` record offset): 0, 1, 2, …
/// in append order, never reused within the shard.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
#[repr(transparent)]
pub struct Offset(pub u64);

impl fmt::Display for Offset {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

/// A connection's id, unique within this node's run (from `Shared::next_id`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
#[repr(transparent)]
pub struct ConnId(pub u64);

impl ConnId {
    /// First of the ids the broker makes up for its own publishes (dead-letter copies): far
    /// above what the connection id counter reaches, below the 48 bits a peer's id keeps.
    pub const FIRST_PSEUDO: u64 = 1 << 47;

    /// A fresh made-up id for one of the broker's own publishes: its confirms from another
    /// node come back to that publish alone (`remote::client`).
    pub fn pseudo() -> ConnId {
        static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(ConnId::FIRST_PSEUDO);
        ConnId(NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed))
    }

    /// True for an id [`ConnId::pseudo`] made.
    pub fn is_pseudo(self) -> bool {
        self.0 >= ConnId::FIRST_PSEUDO
    }
}

impl fmt::Display for ConnId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

/// A channel number on a connection (AMQP 0-9-1 §4.2.3 frame header "channel": 1 to
/// channel-max; 0 is the connection itself).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
#[repr(transparent)]
pub struct ChannelId(pub u16);

impl fmt::Display for ChannelId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

/// A cheap-to-clone text name (`Arc<str>`) with the accessors every such name has.
macro_rules! text_name {
    ($(#[$doc:meta])* $name:ident) => {
        $(#[$doc])*
        #[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
        pub struct $name(pub Arc<str>);

        impl $name {
            /// The name as text.
            pub fn as_str(&self) -> &str {
                &self.0
            }
        }

        impl From<&str> for $name {
            fn from(s: &str) -> Self {
                $name(Arc::from(s))
            }
        }

        impl std::ops::Deref for $name {
            type Target = str;
            fn deref(&self) -> &str {
                &self.0
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(&self.0)
            }
        }
    };
}

text_name!(
    /// A consumer tag (basic.consume's `consumer-tag`, AMQP 0-9-1 §1.8.3.3: a short string
    /// unique per channel), cheap to clone and to send between cores.
    ConsumerTag
);

text_name!(
    /// A queue's name within its vhost (AMQP 0-9-1 `queue-name`: a short string, at most 255
    /// bytes), cheap to clone and to send between cores.
    QueueName
);
