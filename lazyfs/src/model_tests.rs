//! The model without FUSE: each test drives [`Disk`] the way the filesystem layer does (change
//! the backing directory through it, or change it and journal) and checks what a crash leaves.

use super::*;
use std::io::Write;

/// A model over a fresh temp dir.
fn disk() -> (tempfile::TempDir, Disk) {
    let dir = tempfile::tempdir().unwrap();
    let disk = Disk::open(dir.path()).unwrap();
    (dir, disk)
}

/// Creates `name` in the root with `bytes`, through the model (journaled), and returns its handle
/// and inode.
fn create(d: &mut Disk, name: &str, bytes: &[u8]) -> (Arc<File>, Ino) {
    let p = d.root().join(name);
    let f = Arc::new(File::options().read(true).write(true).create_new(true).open(&p).unwrap());
    let ino = f.metadata().unwrap().ino();
    let root = d.root_ino();
    d.created(root, Path::new(name));
    d.remember(root, Path::new(name), ino);
    write(d, &f, ino, 0, bytes);
    (f, ino)
}

fn write(d: &mut Disk, f: &Arc<File>, ino: Ino, off: u64, bytes: &[u8]) {
    d.before_write(ino, f, off, bytes.len() as u64).unwrap();
    f.write_all_at(bytes, off).unwrap();
}

fn read(d: &Disk, name: &str) -> Option<Vec<u8>> {
    std::fs::read(d.root().join(name)).ok()
}

/// A file that exists durably before the model starts (the state a previous run left).
fn durable_file(dir: &tempfile::TempDir, name: &str, bytes: &[u8]) {
    let mut f = File::create(dir.path().join(name)).unwrap();
    f.write_all(bytes).unwrap();
}

#[test]
fn unsynced_writes_are_seen_then_dropped() {
    let (dir, mut d) = disk();
    durable_file(&dir, "a", b"hello world");
    let f = Arc::new(File::options().read(true).write(true).open(dir.path().join("a")).unwrap());
    let ino = f.metadata().unwrap().ino();
    write(&mut d, &f, ino, 6, b"WORLD");
    write(&mut d, &f, ino, 8, b"rld and more");
    assert_eq!(read(&d, "a").unwrap(), b"hello WOrld and more", "reads see the pending writes merged");
    let r = d.crash();
    assert_eq!((r.files, r.writes, r.failures), (1, 2, 0), "{:?}", r.lines);
    assert_eq!(read(&d, "a").unwrap(), b"hello world", "the durable contents and size come back");
}

#[test]
fn fsync_makes_writes_durable() {
    let (dir, mut d) = disk();
    durable_file(&dir, "a", b"0123456789");
    let f = Arc::new(File::options().read(true).write(true).open(dir.path().join("a")).unwrap());
    let ino = f.metadata().unwrap().ino();
    write(&mut d, &f, ino, 0, b"ab");
    d.sync_file(ino).unwrap();
    write(&mut d, &f, ino, 4, b"xy");
    write(&mut d, &f, ino, 10, b"tail");
    d.crash();
    assert_eq!(read(&d, "a").unwrap(), b"ab23456789", "the synced write stays, the later ones go");
}

#[test]
fn truncate_then_crash_restores_the_cut_bytes() {
    let (dir, mut d) = disk();
    durable_file(&dir, "a", b"abcdefgh");
    let f = Arc::new(File::options().read(true).write(true).open(dir.path().join("a")).unwrap());
    let ino = f.metadata().unwrap().ino();
    d.before_resize(ino, &f, 2).unwrap();
    f.set_len(2).unwrap();
    write(&mut d, &f, ino, 2, b"ZZZZZZZZZZ");
    assert_eq!(read(&d, "a").unwrap(), b"abZZZZZZZZZZ");
    d.crash();
    assert_eq!(read(&d, "a").unwrap(), b"abcdefgh");
}

#[test]
fn a_new_file_needs_its_directory_fsynced() {
    let (_dir, mut d) = disk();
    let (_f, ino) = create(&mut d, "new", b"data");
    d.sync_file(ino).unwrap();
    let r = d.crash();
    assert_eq!(read(&d, "new"), None, "file fsynced, directory not: the name is gone ({:?})", r.lines);
    assert_eq!(r.names, 1);
}

#[test]
fn directory_fsync_makes_the_name_durable() {
    let (_dir, mut d) = disk();
    let (_f, ino) = create(&mut d, "new", b"data");
    let root = d.root_ino();
    d.sync_dir(root).unwrap();
    let r = d.crash();
    assert_eq!(read(&d, "new").unwrap(), b"", "the name stays, its unsynced contents go ({:?})", r.lines);
    let (_dir2, mut d2) = disk();
    let (_f2, ino2) = create(&mut d2, "new", b"data");
    d2.sync_file(ino2).unwrap();
    d2.sync_dir(d2.root_ino()).unwrap();
    d2.crash();
    assert_eq!(read(&d2, "new").unwrap(), b"data", "file and directory fsynced: all of it stays");
    let _ = ino;
}

#[test]
fn unlink_is_undone_until_the_directory_is_fsynced() {
    let (dir, mut d) = disk();
    durable_file(&dir, "old", b"keep me");
    let root = d.root_ino();
    d.remove(root, Path::new("old"), false).unwrap();
    assert_eq!(read(&d, "old"), None, "gone from the namespace at once");
    d.crash();
    assert_eq!(read(&d, "old").unwrap(), b"keep me", "the unlink was not durable");

    let (dir, mut d) = disk();
    durable_file(&dir, "old", b"x");
    let root = d.root_ino();
    d.remove(root, Path::new("old"), false).unwrap();
    d.sync_dir(root).unwrap();
    assert_eq!(std::fs::read_dir(dir.path().join(TRASH)).unwrap().count(), 0, "a durable unlink empties its trash");
    d.crash();
    assert_eq!(read(&d, "old"), None);
}

#[test]
fn rename_over_a_file_is_undone_with_the_replaced_file_back() {
    let (dir, mut d) = disk();
    durable_file(&dir, "snap", b"old snapshot");
    let (f, ino) = create(&mut d, "snap.tmp", b"new snapshot");
    d.sync_file(ino).unwrap();
    let root = d.root_ino();
    d.rename((root, Path::new("snap.tmp")), (root, Path::new("snap")), false).unwrap();
    assert_eq!(read(&d, "snap").unwrap(), b"new snapshot");
    let r = d.crash();
    assert_eq!(read(&d, "snap").unwrap(), b"old snapshot", "{:?}", r.lines);
    assert_eq!(read(&d, "snap.tmp"), None, "the temp file's own create was not durable either");
    drop(f);
}

#[test]
fn rename_made_durable_by_the_directory_fsync() {
    let (dir, mut d) = disk();
    durable_file(&dir, "snap", b"old");
    let (_f, ino) = create(&mut d, "snap.tmp", b"new");
    d.sync_file(ino).unwrap();
    let root = d.root_ino();
    d.rename((root, Path::new("snap.tmp")), (root, Path::new("snap")), false).unwrap();
    d.sync_dir(root).unwrap();
    let r = d.crash();
    assert_eq!(read(&d, "snap").unwrap(), b"new", "{:?}", r.lines);
    assert_eq!(r.names, 0);
}

#[test]
fn a_new_directory_and_its_files_go_together() {
    let (dir, mut d) = disk();
    let root = d.root_ino();
    std::fs::create_dir(dir.path().join("q")).unwrap();
    let q = std::fs::metadata(dir.path().join("q")).unwrap().ino();
    d.created(root, Path::new("q"));
    d.remember(root, Path::new("q"), q);
    let p = dir.path().join("q/seg");
    let f = Arc::new(File::options().read(true).write(true).create_new(true).open(&p).unwrap());
    d.created(q, Path::new("seg"));
    d.sync_dir(q).unwrap();
    let ino = f.metadata().unwrap().ino();
    write(&mut d, &f, ino, 0, b"x");
    d.sync_file(ino).unwrap();
    let r = d.crash();
    assert!(!dir.path().join("q").exists(), "the root was never fsynced: q is gone with its file ({:?})", r.lines);
}

#[test]
fn everything_fails_after_the_crash() {
    let (_dir, mut d) = disk();
    d.crash();
    assert!(d.crashed());
    assert_eq!(d.sync_dir(d.root_ino()).unwrap_err().raw_os_error(), Some(libc::EIO));
    assert!(d.crash().lines.is_empty(), "a second crash drops nothing");
}

#[test]
fn rmdir_refuses_a_non_empty_directory_and_is_undone() {
    let (dir, mut d) = disk();
    std::fs::create_dir_all(dir.path().join("a/b")).unwrap();
    let root = d.root_ino();
    let err = d.remove(root, Path::new("a"), true).unwrap_err();
    assert_eq!(err.raw_os_error(), Some(libc::ENOTEMPTY));
    let a = std::fs::metadata(dir.path().join("a")).unwrap().ino();
    d.remember(root, Path::new("a"), a);
    d.remove(a, Path::new("b"), true).unwrap();
    assert!(!dir.path().join("a/b").exists());
    d.crash();
    assert!(dir.path().join("a/b").is_dir());
}
