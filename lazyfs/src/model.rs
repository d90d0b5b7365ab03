//! The disk model: what a power loss keeps of the backing directory.
//!
//! Every change is applied to the backing directory at once (so reads, sizes, `mmap` and
//! directory listings need no merging), and what is needed to take it back is kept in memory
//! until it is made durable:
//!
//! - **File contents** ([`FileUndo`], per backing inode): the size the file had when it was last
//!   durable, and the old bytes of every range below that size written, truncated away or punched
//!   since (saved once, at the first change of each byte). `fsync`/`fdatasync` of any handle of
//!   the file drops them: everything written so far is durable.
//! - **Names** ([`NsOp`], a journal in call order): a create (file or directory), a remove (unlink
//!   or rmdir: the entry is moved into a hidden trash directory instead of being deleted) and a
//!   rename (an entry it replaces is moved to the trash first). An operation is durable once every
//!   directory it touched has been fsynced after it; its trash is then deleted.
//!
//! [`Disk::crash`] is the power loss: it writes the saved bytes back and cuts every file to its
//! durable size, then undoes the journal's non-durable operations newest first, and reports what
//! it dropped. The model is then spent: every later call fails with EIO.
//!
//! # Assumptions
//! - The disk keeps every write it was given until it loses power, and loses all of a file's
//!   writes since its last fsync (no partial or reordered loss within a file: one crash point).
//! - A file's fsync does not make its own directory entry durable (POSIX; ext4 usually does in
//!   practice, through its journal): a name needs its directory fsynced, both directories for a
//!   rename.
//! - A name change whose undo finds its path gone (because a later durable change moved it) is
//!   reported and skipped, not fatal.
//! - One process owns the backing directory: nothing else changes it while the model runs.

use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::io;
use std::os::unix::fs::{FileExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// Name of the hidden directory (in the backing root) that holds removed and replaced entries
/// until their removal is durable.
pub const TRASH: &str = ".lazyfs-trash";

/// A backing inode number (`st_ino` in the backing filesystem).
pub type Ino = u64;

/// What a file had when it was last durable, for the writes made since.
#[derive(Debug)]
pub struct FileUndo {
    /// A handle on the file that stays valid across renames and unlinks.
    file: Arc<File>,
    /// Size (bytes) at the last fsync (or when the model first saw the file change).
    durable_len: u64,
    /// Old bytes by offset, non-overlapping, each inside `0..durable_len`.
    old: BTreeMap<u64, Vec<u8>>,
    /// Writes (write, truncate, fallocate) since the last fsync.
    writes: u64,
    /// Bytes those writes covered.
    bytes: u64,
}

/// A name change the model can take back.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NsKind {
    /// `name` was created in directory `dir` (file or directory).
    Create {
        /// Directory inode.
        dir: Ino,
        /// Entry name.
        name: PathBuf,
    },
    /// `name` was removed from `dir`; it waits at `trash` (relative to the backing root).
    Remove {
        /// Directory inode.
        dir: Ino,
        /// Entry name.
        name: PathBuf,
        /// Where the removed entry waits.
        trash: PathBuf,
    },
    /// `from_dir/from` was renamed to `to_dir/to`; the entry it replaced waits at `displaced`.
    Rename {
        /// Source directory inode.
        from_dir: Ino,
        /// Source name.
        from: PathBuf,
        /// Target directory inode.
        to_dir: Ino,
        /// Target name.
        to: PathBuf,
        /// Where the replaced target waits, if there was one.
        displaced: Option<PathBuf>,
    },
}

/// A journal entry: the change and the directories that still need an fsync for it.
#[derive(Debug)]
pub struct NsOp {
    /// The change.
    pub kind: NsKind,
    /// Directories (inodes) not yet fsynced since the change.
    waiting: Vec<Ino>,
}

/// What a crash dropped, for the log and the tests.
#[derive(Debug, Default)]
pub struct CrashReport {
    /// One line per dropped item, e.g. "dropped 3 writes (12288 bytes) of q/0.seg".
    pub lines: Vec<String>,
    /// Files whose unsynced writes were dropped.
    pub files: usize,
    /// Unsynced writes dropped.
    pub writes: u64,
    /// Name changes undone.
    pub names: usize,
    /// Undo steps that failed (a path already gone); listed in `lines` too.
    pub failures: usize,
}

/// The model over one backing directory; see the module doc.
#[derive(Debug)]
pub struct Disk {
    /// The backing directory (absolute).
    root: PathBuf,
    /// Backing inode of the root.
    root_ino: Ino,
    /// Known inodes and their paths relative to `root` ("" is the root).
    paths: HashMap<Ino, PathBuf>,
    /// Files changed since their last fsync.
    files: HashMap<Ino, FileUndo>,
    /// Name changes not yet durable, oldest first.
    journal: Vec<NsOp>,
    /// Next trash entry number.
    next_trash: u64,
    /// The power is gone: every call fails.
    crashed: bool,
}

fn eio() -> io::Error {
    io::Error::from_raw_os_error(libc::EIO)
}

impl Disk {
    /// The model over `root`; makes (or empties, dropping what an earlier run left) the trash.
    pub fn open(root: &Path) -> io::Result<Disk> {
        let root = std::fs::canonicalize(root)?;
        let trash = root.join(TRASH);
        if trash.exists() {
            std::fs::remove_dir_all(&trash)?;
        }
        std::fs::create_dir(&trash)?;
        let root_ino = std::fs::metadata(&root)?.ino();
        let paths = HashMap::from([(root_ino, PathBuf::new())]);
        Ok(Disk { root, root_ino, paths, files: HashMap::new(), journal: Vec::new(), next_trash: 0, crashed: false })
    }

    /// The backing root.
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// The backing inode of the root.
    pub fn root_ino(&self) -> Ino {
        self.root_ino
    }

    /// True after [`Disk::crash`].
    pub fn crashed(&self) -> bool {
        self.crashed
    }

    /// EIO after the crash.
    pub fn alive(&self) -> io::Result<()> {
        if self.crashed {
            Err(eio())
        } else {
            Ok(())
        }
    }

    /// The backing path of inode `ino`, if known.
    pub fn path(&self, ino: Ino) -> Option<PathBuf> {
        self.paths.get(&ino).map(|p| self.root.join(p))
    }

    /// The backing path of `name` in directory `dir`.
    pub fn child(&self, dir: Ino, name: &Path) -> io::Result<PathBuf> {
        self.path(dir).map(|p| p.join(name)).ok_or_else(|| io::Error::from_raw_os_error(libc::ENOENT))
    }

    /// Remembers that `name` in `dir` is inode `ino`.
    pub fn remember(&mut self, dir: Ino, name: &Path, ino: Ino) {
        if let Some(d) = self.paths.get(&dir) {
            let p = d.join(name);
            self.paths.insert(ino, p);
        }
    }

    /// Call before writing `len` bytes at `off` of inode `ino` (open as `file`): saves the old
    /// bytes the write replaces.
    pub fn before_write(&mut self, ino: Ino, file: &Arc<File>, off: u64, len: u64) -> io::Result<()> {
        self.alive()?;
        let u = self.undo(ino, file)?;
        u.writes += 1;
        u.bytes += len;
        u.save(off, off.saturating_add(len))
    }

    /// Call before setting the size of inode `ino` to `len` (truncate, extend).
    pub fn before_resize(&mut self, ino: Ino, file: &Arc<File>, len: u64) -> io::Result<()> {
        self.alive()?;
        let u = self.undo(ino, file)?;
        u.writes += 1;
        let end = u.durable_len;
        u.save(len, end)
    }

    fn undo(&mut self, ino: Ino, file: &Arc<File>) -> io::Result<&mut FileUndo> {
        match self.files.entry(ino) {
            std::collections::hash_map::Entry::Occupied(e) => Ok(e.into_mut()),
            std::collections::hash_map::Entry::Vacant(e) => {
                let durable_len = file.metadata()?.len();
                Ok(e.insert(FileUndo { file: file.clone(), durable_len, old: BTreeMap::new(), writes: 0, bytes: 0 }))
            }
        }
    }

    /// fsync or fdatasync of inode `ino`: its contents and size are durable.
    pub fn sync_file(&mut self, ino: Ino) -> io::Result<()> {
        self.alive()?;
        self.files.remove(&ino);
        Ok(())
    }

    /// Journals the creation (already made) of `name` in `dir`.
    pub fn created(&mut self, dir: Ino, name: &Path) {
        self.journal.push(NsOp { kind: NsKind::Create { dir, name: name.to_owned() }, waiting: vec![dir] });
    }

    fn trash_slot(&mut self) -> PathBuf {
        self.next_trash += 1;
        Path::new(TRASH).join(self.next_trash.to_string())
    }

    /// Moves `from` (absolute) to a new trash slot, returns the slot (relative).
    fn move_to_trash(&mut self, from: &Path) -> io::Result<PathBuf> {
        let slot = self.trash_slot();
        std::fs::rename(from, self.root.join(&slot))?;
        self.moved(from, &self.root.join(&slot));
        Ok(slot)
    }

    /// Updates the known paths after `from` (absolute) became `to` (absolute).
    fn moved(&mut self, from: &Path, to: &Path) {
        let (Ok(from), Ok(to)) = (from.strip_prefix(&self.root), to.strip_prefix(&self.root)) else { return };
        for p in self.paths.values_mut() {
            if let Ok(rest) = p.strip_prefix(from) {
                *p = if rest.as_os_str().is_empty() { to.to_owned() } else { to.join(rest) };
            }
        }
    }

    /// unlink (`is_dir` false) or rmdir (true) of `name` in `dir`: the entry goes to the trash.
    pub fn remove(&mut self, dir: Ino, name: &Path, is_dir: bool) -> io::Result<()> {
        self.alive()?;
        let p = self.child(dir, name)?;
        let md = std::fs::symlink_metadata(&p)?;
        if is_dir != md.is_dir() {
            return Err(io::Error::from_raw_os_error(if is_dir { libc::ENOTDIR } else { libc::EISDIR }));
        }
        if is_dir && std::fs::read_dir(&p)?.next().is_some() {
            return Err(io::Error::from_raw_os_error(libc::ENOTEMPTY));
        }
        let trash = self.move_to_trash(&p)?;
        self.journal.push(NsOp { kind: NsKind::Remove { dir, name: name.to_owned(), trash }, waiting: vec![dir] });
        Ok(())
    }

    /// rename of `from_dir/from` to `to_dir/to`; a replaced target goes to the trash.
    /// `noreplace`: RENAME_NOREPLACE (EEXIST when the target exists).
    pub fn rename(&mut self, (from_dir, from): (Ino, &Path), (to_dir, to): (Ino, &Path), noreplace: bool) -> io::Result<()> {
        self.alive()?;
        let src = self.child(from_dir, from)?;
        let dst = self.child(to_dir, to)?;
        let smd = std::fs::symlink_metadata(&src)?;
        if src == dst {
            return Ok(());
        }
        let displaced = match std::fs::symlink_metadata(&dst) {
            Ok(_) if noreplace => return Err(io::Error::from_raw_os_error(libc::EEXIST)),
            Ok(dmd) => {
                if smd.is_dir() && !dmd.is_dir() {
                    return Err(io::Error::from_raw_os_error(libc::ENOTDIR));
                }
                if !smd.is_dir() && dmd.is_dir() {
                    return Err(io::Error::from_raw_os_error(libc::EISDIR));
                }
                if dmd.is_dir() && std::fs::read_dir(&dst)?.next().is_some() {
                    return Err(io::Error::from_raw_os_error(libc::ENOTEMPTY));
                }
                Some(self.move_to_trash(&dst)?)
            }
            Err(e) if e.kind() == io::ErrorKind::NotFound => None,
            Err(e) => return Err(e),
        };
        if let Err(e) = std::fs::rename(&src, &dst) {
            if let Some(slot) = &displaced {
                let _ = std::fs::rename(self.root.join(slot), &dst);
                self.moved(&self.root.join(slot), &dst);
            }
            return Err(e);
        }
        self.moved(&src, &dst);
        let mut waiting = vec![from_dir];
        if to_dir != from_dir {
            waiting.push(to_dir);
        }
        let kind = NsKind::Rename { from_dir, from: from.to_owned(), to_dir, to: to.to_owned(), displaced };
        self.journal.push(NsOp { kind, waiting });
        Ok(())
    }

    /// fsync of directory `dir`: every name change that waited only for it is durable (and its
    /// trash deleted).
    pub fn sync_dir(&mut self, dir: Ino) -> io::Result<()> {
        self.alive()?;
        let mut kept = Vec::with_capacity(self.journal.len());
        for mut op in std::mem::take(&mut self.journal) {
            op.waiting.retain(|d| *d != dir);
            if !op.waiting.is_empty() {
                kept.push(op);
                continue;
            }
            let trash = match &op.kind {
                NsKind::Remove { trash, .. } => Some(trash),
                NsKind::Rename { displaced, .. } => displaced.as_ref(),
                NsKind::Create { .. } => None,
            };
            if let Some(t) = trash {
                let p = self.root.join(t);
                if let Some(ino) = std::fs::symlink_metadata(&p).ok().map(|m| m.ino()) {
                    self.files.remove(&ino);
                }
                let _ = if p.is_dir() { std::fs::remove_dir_all(&p) } else { std::fs::remove_file(&p) };
            }
        }
        self.journal = kept;
        Ok(())
    }

    /// Files with unsynced writes and name changes not yet durable.
    pub fn pending(&self) -> (usize, usize) {
        (self.files.len(), self.journal.len())
    }

    /// The known relative path of `ino`, for a report.
    fn shown(&self, ino: Ino) -> String {
        self.paths.get(&ino).map_or_else(|| format!("inode {ino}"), |p| p.display().to_string())
    }

    /// The power loss; see the module doc. The model is spent after it.
    pub fn crash(&mut self) -> CrashReport {
        let mut r = CrashReport::default();
        if self.crashed {
            return r;
        }
        self.crashed = true;
        let mut files: Vec<(Ino, FileUndo)> = self.files.drain().collect();
        files.sort_by_key(|(ino, _)| *ino);
        for (ino, u) in files {
            let name = self.shown(ino);
            let len = u.file.metadata().map(|m| m.len()).unwrap_or(0);
            r.files += 1;
            r.writes += u.writes;
            r.lines.push(format!(
                "dropped {} writes ({} bytes) of {name}: size {len} -> {}, {} old ranges restored",
                u.writes,
                u.bytes,
                u.durable_len,
                u.old.len()
            ));
            if let Err(e) = u.restore() {
                r.failures += 1;
                r.lines.push(format!("FAILED to restore {name}: {e}"));
            }
        }
        let journal = std::mem::take(&mut self.journal);
        for op in journal.iter().rev() {
            r.names += 1;
            match self.undo_ns(&op.kind) {
                Ok(what) => r.lines.push(what),
                Err(e) => {
                    r.failures += 1;
                    r.lines.push(format!("FAILED to undo {:?}: {e}", op.kind));
                }
            }
        }
        r
    }

    fn rel(&self, dir: Ino, name: &Path) -> String {
        format!("{}/{}", self.shown(dir), name.display()).trim_start_matches('/').to_owned()
    }

    fn undo_ns(&mut self, kind: &NsKind) -> io::Result<String> {
        match kind {
            NsKind::Create { dir, name } => {
                let p = self.child(*dir, name)?;
                let md = std::fs::symlink_metadata(&p)?;
                if md.is_dir() {
                    std::fs::remove_dir_all(&p)?;
                } else {
                    std::fs::remove_file(&p)?;
                }
                Ok(format!("undid the create of {} (its directory was not fsynced)", self.rel(*dir, name)))
            }
            NsKind::Remove { dir, name, trash } => {
                let p = self.child(*dir, name)?;
                std::fs::rename(self.root.join(trash), &p)?;
                Ok(format!("undid the removal of {} (its directory was not fsynced)", self.rel(*dir, name)))
            }
            NsKind::Rename { from_dir, from, to_dir, to, displaced } => {
                let src = self.child(*from_dir, from)?;
                let dst = self.child(*to_dir, to)?;
                std::fs::rename(&dst, &src)?;
                self.moved(&dst, &src);
                if let Some(t) = displaced {
                    std::fs::rename(self.root.join(t), &dst)?;
                }
                Ok(format!(
                    "undid the rename of {} to {}{} (a directory was not fsynced)",
                    self.rel(*from_dir, from),
                    self.rel(*to_dir, to),
                    if displaced.is_some() { ", the replaced file restored" } else { "" }
                ))
            }
        }
    }
}

impl FileUndo {
    /// Saves the old bytes of `start..end` clipped to the durable size, where not saved yet.
    fn save(&mut self, start: u64, end: u64) -> io::Result<()> {
        let end = end.min(self.durable_len);
        let mut at = start;
        while at < end {
            // The saved range that covers `at`, or the next one after it.
            if let Some((&s, v)) = self.old.range(..=at).next_back() {
                if s + v.len() as u64 > at {
                    at = s + v.len() as u64;
                    continue;
                }
            }
            let gap_end = self.old.range(at..).next().map_or(end, |(&s, _)| s.min(end));
            let mut buf = vec![0u8; (gap_end - at) as usize];
            let mut got = 0;
            while got < buf.len() {
                match self.file.read_at(&mut buf[got..], at + got as u64)? {
                    0 => break, // past the current end: those bytes read as zeros
                    n => got += n,
                }
            }
            self.old.insert(at, buf);
            at = gap_end;
        }
        Ok(())
    }

    /// Cuts (or extends) the file to its durable size and writes the old bytes back.
    fn restore(&self) -> io::Result<()> {
        self.file.set_len(self.durable_len)?;
        for (off, bytes) in &self.old {
            self.file.write_all_at(bytes, *off)?;
        }
        Ok(())
    }
}

#[cfg(test)]
#[path = "model_tests.rs"]
mod tests;
