//! raft-rs logs through slog; this forwards its records to `tracing`.

use std::fmt::Write as _;

/// Forwards raft-rs's slog records to `tracing` (target `ringmq::meta::raft`); raft-rs's info
/// lines (elections, role changes) become debug events.
pub(super) struct TracingDrain;

struct KvText(String);

impl slog::Serializer for KvText {
    fn emit_arguments(&mut self, key: slog::Key, val: &std::fmt::Arguments<'_>) -> slog::Result {
        let _ = write!(self.0, " {key}={val}");
        Ok(())
    }
}

impl slog::Drain for TracingDrain {
    type Ok = ();
    type Err = slog::Never;

    fn log(&self, record: &slog::Record<'_>, values: &slog::OwnedKVList) -> Result<(), slog::Never> {
        use slog::KV as _;
        let mut kv = KvText(String::new());
        let _ = record.kv().serialize(record, &mut kv);
        let _ = values.serialize(record, &mut kv);
        match record.level() {
            slog::Level::Critical | slog::Level::Error => {
                tracing::error!(target: "ringmq::meta::raft", "{}{}", record.msg(), kv.0)
            }
            slog::Level::Warning => {
                tracing::warn!(target: "ringmq::meta::raft", "{}{}", record.msg(), kv.0)
            }
            slog::Level::Info | slog::Level::Debug => {
                tracing::debug!(target: "ringmq::meta::raft", "{}{}", record.msg(), kv.0)
            }
            slog::Level::Trace => {
                tracing::trace!(target: "ringmq::meta::raft", "{}{}", record.msg(), kv.0)
            }
        }
        Ok(())
    }
}
