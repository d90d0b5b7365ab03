//! A queue's files outside its shards, and the filesystem calls a core makes on them, each
//! on glommio's blocking thread (a core never blocks): where a queue's store lives, the
//! incarnation marker that ties a durable store to its declaration, the probe that tells a
//! full disk took writes again, and the removal of a deleted queue's files.

use std::path::PathBuf;
use std::rc::Rc;

use crate::config::Config;
use crate::meta::state::QueueDef;

/// The directory of a queue's shards: durable queues (not exclusive) under `queues/`, the
/// others under `transient/` (emptied at every start); see [`Config::queue_dir`].
pub fn queue_dir(config: &Config, def: &QueueDef) -> PathBuf {
    config.queue_dir(&def.vhost, &def.name, def.survives_restart())
}

/// The queue directories of this node whose files are being removed (a deleted queue's), so
/// that a queue of the same name declared meanwhile, possibly on another core, opens its
/// store only once they are gone, instead of racing the removal for the same files (a
/// transient queue's directory is named after the queue alone; a durable one's store is
/// claimed by its incarnation marker, which the removal would take too).
#[derive(Debug, Default)]
pub struct Removals(std::sync::Mutex<std::collections::HashSet<PathBuf>>);

/// Longest an open waits for a removal of its directory ([`Removals::wait`]).
const REMOVAL_WAIT: std::time::Duration = std::time::Duration::from_secs(10);

impl Removals {
    /// `dir`'s files are about to be removed.
    pub fn begin(&self, dir: PathBuf) {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).insert(dir);
    }

    /// `dir`'s removal is over (done or failed).
    pub fn end(&self, dir: &std::path::Path) {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).remove(dir);
    }

    fn busy(&self, dir: &std::path::Path) -> bool {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).contains(dir)
    }

    /// Waits (polling every millisecond, [`REMOVAL_WAIT`] at most) until no removal of
    /// `dir` is under way.
    pub async fn wait(&self, dir: &std::path::Path) {
        let deadline = std::time::Instant::now() + REMOVAL_WAIT;
        while self.busy(dir) && std::time::Instant::now() < deadline {
            glommio::timer::sleep(std::time::Duration::from_millis(1)).await;
        }
    }
}

/// True when a 4 KiB write and fdatasync of a probe file in `dir` succeed (on the blocking
/// thread): the filesystem takes writes again.
pub(super) async fn writable(dir: PathBuf) -> bool {
    glommio::executor()
        .spawn_blocking(move || {
            use std::io::Write;
            let p = dir.join(".write-probe");
            let ok = std::fs::File::create(&p).and_then(|mut f| f.write_all(&[0u8; 4096]).and_then(|_| f.sync_data())).is_ok();
            let _ = std::fs::remove_file(&p);
            ok
        })
        .await
}

/// Removes a deleted queue's shards (message shard, unacked index) and their files, when
/// nothing else holds them.
pub(super) async fn destroy_shards(shard: Rc<ringmq_shards::Shard>, index: Option<Rc<ringmq_shards::Shard>>) {
    for shard in [Some(shard), index].into_iter().flatten() {
        if let Ok(shard) = Rc::try_unwrap(shard) {
            if let Err(e) = shard.destroy().await {
                tracing::warn!(error = %e, "removing queue files failed");
            }
        }
    }
}

/// Removes a deleted replicated queue's directory and everything in it, on the blocking
/// thread.
pub(super) async fn remove_replica_files(dir: PathBuf) {
    glommio::executor().spawn_blocking(move || drop(std::fs::remove_dir_all(&dir))).await
}

/// File in a durable queue's directory naming the declaration its store belongs to
/// (`QueueDef::incarnation`, 16 hex digits).
const INCARNATION_FILE: &str = "incarnation";

/// Makes the store in `dir` the one of declaration `incarnation` before it opens (on the
/// blocking thread): a store marked with another declaration was left by an earlier queue of
/// the same name (deleted while this node was down, or a crash mid-delete) and is removed; an
/// unmarked one (written before markers existed) is kept; then the marker is written and
/// synced, with its directory, before any shard file exists.
///
/// # Errors
/// [`ringmq_shards::StoreError`] when the marker cannot be read or written, or the stale store
/// cannot be removed (disk full included).
pub(super) async fn claim_store(dir: PathBuf, incarnation: u64, queue: String) -> Result<(), ringmq_shards::StoreError> {
    use ringmq_shards::StoreError;
    glommio::executor()
        .spawn_blocking(move || {
            let marker = dir.join(INCARNATION_FILE);
            let mine = format!("{incarnation:016x}");
            match std::fs::read_to_string(&marker) {
                Ok(text) if text.trim() == mine => return Ok(()),
                Ok(text) => {
                    tracing::warn!(queue = %queue, found = %text.trim(), declared = %mine, "discarding a store an earlier queue of this name left on disk");
                    for sub in ["messages", "unacked"] {
                        match std::fs::remove_dir_all(dir.join(sub)) {
                            Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(StoreError::io("removing stale store", dir.join(sub), e)),
                            _ => {}
                        }
                    }
                }
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => return Err(StoreError::io("reading", marker, e)),
            }
            ringmq_shards::create_dir_all_durable(&dir).map_err(|e| StoreError::io("creating", &dir, e))?;
            let tmp = dir.join(format!("{INCARNATION_FILE}.tmp"));
            let write = |f: &mut std::fs::File| {
                use std::io::Write;
                f.write_all(mine.as_bytes())?;
                f.sync_all()
            };
            std::fs::File::create(&tmp).and_then(|mut f| write(&mut f)).map_err(|e| StoreError::io("writing", &tmp, e))?;
            std::fs::rename(&tmp, &marker).map_err(|e| StoreError::io("renaming", &marker, e))?;
            std::fs::File::open(&dir).and_then(|d| d.sync_all()).map_err(|e| StoreError::io("syncing", &dir, e))
        })
        .await
}

/// Removes a deleted queue's directory (its shards are destroyed already: what is left is its
/// incarnation marker), on the blocking thread.
pub(super) async fn remove_dir(dir: PathBuf) {
    glommio::executor()
        .spawn_blocking(move || {
            let _ = std::fs::remove_file(dir.join(INCARNATION_FILE));
            drop(std::fs::remove_dir(&dir))
        })
        .await
}
