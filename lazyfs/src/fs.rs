//! The FUSE passthrough: every request is carried out on the backing directory through the
//! [`Disk`] model, which keeps what a power loss would take back.
//!
//! Inode numbers are the backing filesystem's (`st_ino`), the root's mapped to FUSE's 1. Every
//! request runs under one lock (the model and the backing directory change together). Files are
//! opened on the backing side without `O_DIRECT`, `O_APPEND` or `O_TRUNC` (the kernel sends the
//! offsets and a truncate as a setattr), and replies never ask for FUSE's direct I/O, so shared
//! `mmap` works (its dirty pages reach us as writes on msync, fsync or writeback).

use std::collections::HashMap;
use std::ffi::OsStr;
use std::fs::{File, Metadata};
use std::io;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{FileExt, FileTypeExt, MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::Path;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use fuser::{
    Errno, FileAttr, FileHandle, FileType, Filesystem, FopenFlags, Generation, INodeNo, LockOwner, OpenFlags, RenameFlags, ReplyAttr,
    ReplyCreate, ReplyData, ReplyDirectory, ReplyEmpty, ReplyEntry, ReplyOpen, ReplyStatfs, ReplyWrite, Request, TimeOrNow, WriteFlags,
};

use crate::model::{Disk, Ino, TRASH};

/// How long the kernel may cache an entry or attributes: short, as nothing else changes the
/// backing directory and our own replies keep them current.
const TTL: Duration = Duration::from_secs(1);

/// The filesystem: the model and the open handles.
pub struct LazyFs {
    /// The model and, with it, the backing directory (shared with the control interface).
    disk: Arc<Mutex<Disk>>,
    /// Open file handles by FUSE file handle.
    handles: Mutex<HashMap<u64, (Ino, Arc<File>)>>,
    /// The next file handle.
    next_fh: Mutex<u64>,
}

/// A reply error from an I/O error.
fn errno(e: io::Error) -> Errno {
    Errno::from_i32(e.raw_os_error().unwrap_or(libc::EIO))
}

fn kind(md: &Metadata) -> FileType {
    let t = md.file_type();
    if t.is_dir() {
        FileType::Directory
    } else if t.is_symlink() {
        FileType::Symlink
    } else if t.is_fifo() {
        FileType::NamedPipe
    } else if t.is_socket() {
        FileType::Socket
    } else if t.is_block_device() {
        FileType::BlockDevice
    } else if t.is_char_device() {
        FileType::CharDevice
    } else {
        FileType::RegularFile
    }
}

fn time(secs: i64, nsecs: i64) -> SystemTime {
    if secs >= 0 {
        UNIX_EPOCH + Duration::new(secs as u64, nsecs as u32)
    } else {
        UNIX_EPOCH
    }
}

/// A backing file's flags for an open with FUSE `flags`: the access mode only.
fn backing_open(path: &Path, flags: i32) -> io::Result<File> {
    let acc = flags & libc::O_ACCMODE;
    File::options().read(acc != libc::O_WRONLY).write(acc != libc::O_RDONLY).custom_flags(flags & libc::O_NOATIME).open(path)
}

impl LazyFs {
    /// A filesystem over the model `disk`.
    pub fn new(disk: Disk) -> LazyFs {
        LazyFs { disk: Arc::new(Mutex::new(disk)), handles: Mutex::new(HashMap::new()), next_fh: Mutex::new(1) }
    }

    fn disk(&self) -> MutexGuard<'_, Disk> {
        self.disk.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The model, for the control interface: [`Disk::crash`] on it is the power loss, and every
    /// request fails with EIO after it.
    pub fn model(&self) -> Arc<Mutex<Disk>> {
        self.disk.clone()
    }

    /// The backing inode of FUSE inode `ino`.
    fn ino(d: &Disk, ino: INodeNo) -> Ino {
        if ino.0 == 1 {
            d.root_ino()
        } else {
            ino.0
        }
    }

    /// unlink (`dir` false) and rmdir (`dir` true) of `name` in `parent`.
    fn remove(&self, parent: INodeNo, name: &OsStr, dir: bool, reply: ReplyEmpty) {
        let mut d = self.disk();
        let parent = Self::ino(&d, parent);
        match d.remove(parent, Path::new(name), dir) {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(errno(e)),
        }
    }

    fn attr(d: &Disk, md: &Metadata) -> FileAttr {
        let ino = if md.ino() == d.root_ino() { 1 } else { md.ino() };
        FileAttr {
            ino: INodeNo(ino),
            size: md.size(),
            blocks: md.blocks(),
            atime: time(md.atime(), md.atime_nsec()),
            mtime: time(md.mtime(), md.mtime_nsec()),
            ctime: time(md.ctime(), md.ctime_nsec()),
            crtime: time(md.ctime(), md.ctime_nsec()),
            kind: kind(md),
            perm: (md.mode() & 0o7777) as u16,
            nlink: md.nlink() as u32,
            uid: md.uid(),
            gid: md.gid(),
            rdev: md.rdev() as u32,
            flags: 0,
            blksize: md.blksize() as u32,
        }
    }

    fn handle(&self, fh: FileHandle) -> Result<(Ino, Arc<File>), Errno> {
        self.handles.lock().unwrap().get(&fh.0).cloned().ok_or(Errno::EBADF)
    }

    fn add_handle(&self, ino: Ino, f: File) -> FileHandle {
        let mut next = self.next_fh.lock().unwrap();
        let fh = *next;
        *next += 1;
        self.handles.lock().unwrap().insert(fh, (ino, Arc::new(f)));
        FileHandle(fh)
    }

    /// Looks up `name` in `parent` and remembers it.
    fn entry(&self, d: &mut Disk, parent: Ino, name: &OsStr) -> Result<FileAttr, Errno> {
        d.alive().map_err(errno)?;
        if parent == d.root_ino() && name == TRASH {
            return Err(Errno::ENOENT);
        }
        let p = d.child(parent, Path::new(name)).map_err(errno)?;
        let md = std::fs::symlink_metadata(&p).map_err(errno)?;
        d.remember(parent, Path::new(name), md.ino());
        Ok(Self::attr(d, &md))
    }

    /// Sets the size of `ino` (open as `file`, or opened here) to `len`, through the model.
    fn resize(d: &mut Disk, ino: Ino, file: Option<Arc<File>>, len: u64) -> io::Result<()> {
        let file = match file {
            Some(f) => f,
            None => Arc::new(File::options().read(true).write(true).open(d.path(ino).ok_or(io::ErrorKind::NotFound)?)?),
        };
        d.before_resize(ino, &file, len)?;
        file.set_len(len)
    }

    /// Carries out a setattr; returns the new attributes.
    fn set(&self, ino: Ino, a: SetAttr) -> Result<FileAttr, Errno> {
        let mut d = self.disk();
        d.alive().map_err(errno)?;
        let p = d.path(ino).ok_or(Errno::ENOENT)?;
        let file = match a.fh {
            Some(fh) => Some(self.handle(fh)?.1),
            None => None,
        };
        if let Some(mode) = a.mode {
            std::fs::set_permissions(&p, std::fs::Permissions::from_mode(mode)).map_err(errno)?;
        }
        if a.uid.is_some() || a.gid.is_some() {
            std::os::unix::fs::lchown(&p, a.uid, a.gid).map_err(errno)?;
        }
        if let Some(len) = a.size {
            Self::resize(&mut d, ino, file, len).map_err(errno)?;
        }
        if a.atime.is_some() || a.mtime.is_some() {
            let at = |t: TimeOrNow| match t {
                TimeOrNow::SpecificTime(t) => t,
                TimeOrNow::Now => SystemTime::now(),
            };
            let mut times = std::fs::FileTimes::new();
            if let Some(t) = a.atime {
                times = times.set_accessed(at(t));
            }
            if let Some(t) = a.mtime {
                times = times.set_modified(at(t));
            }
            if let Ok(f) = File::open(&p) {
                let _ = f.set_times(times);
            }
        }
        let md = std::fs::symlink_metadata(&p).map_err(errno)?;
        Ok(Self::attr(&d, &md))
    }

    /// Creates a regular file `name` in `parent` and opens it with `flags`.
    fn create_file(&self, parent: Ino, name: &OsStr, mode: u32, flags: i32) -> Result<(FileAttr, Option<FileHandle>), Errno> {
        let mut d = self.disk();
        d.alive().map_err(errno)?;
        let p = d.child(parent, Path::new(name)).map_err(errno)?;
        let acc = flags & libc::O_ACCMODE;
        let f = File::options().read(acc != libc::O_WRONLY).write(true).create_new(true).mode(mode & 0o7777).open(&p).map_err(errno)?;
        d.created(parent, Path::new(name));
        let md = f.metadata().map_err(errno)?;
        d.remember(parent, Path::new(name), md.ino());
        let attr = Self::attr(&d, &md);
        Ok((attr, Some(self.add_handle(md.ino(), f))))
    }
}

/// A setattr's arguments that this filesystem acts on.
struct SetAttr {
    mode: Option<u32>,
    uid: Option<u32>,
    gid: Option<u32>,
    size: Option<u64>,
    atime: Option<TimeOrNow>,
    mtime: Option<TimeOrNow>,
    fh: Option<FileHandle>,
}

impl Filesystem for LazyFs {
    fn lookup(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEntry) {
        let mut d = self.disk();
        let parent = Self::ino(&d, parent);
        match self.entry(&mut d, parent, name) {
            Ok(attr) => reply.entry(&TTL, &attr, Generation(0)),
            Err(e) => reply.error(e),
        }
    }

    fn getattr(&self, _req: &Request, ino: INodeNo, fh: Option<FileHandle>, reply: ReplyAttr) {
        let d = self.disk();
        if d.crashed() {
            return reply.error(Errno::EIO);
        }
        let md = match fh.and_then(|fh| self.handle(fh).ok()) {
            Some((_, f)) => f.metadata(),
            None => match d.path(Self::ino(&d, ino)) {
                Some(p) => std::fs::symlink_metadata(p),
                None => return reply.error(Errno::ENOENT),
            },
        };
        match md {
            Ok(md) => reply.attr(&TTL, &Self::attr(&d, &md)),
            Err(e) => reply.error(errno(e)),
        }
    }

    fn setattr(
        &self,
        _req: &Request,
        ino: INodeNo,
        mode: Option<u32>,
        uid: Option<u32>,
        gid: Option<u32>,
        size: Option<u64>,
        atime: Option<TimeOrNow>,
        mtime: Option<TimeOrNow>,
        _ctime: Option<SystemTime>,
        fh: Option<FileHandle>,
        _crtime: Option<SystemTime>,
        _chgtime: Option<SystemTime>,
        _bkuptime: Option<SystemTime>,
        _flags: Option<fuser::BsdFileFlags>,
        reply: ReplyAttr,
    ) {
        let ino = Self::ino(&self.disk(), ino);
        match self.set(ino, SetAttr { mode, uid, gid, size, atime, mtime, fh }) {
            Ok(attr) => reply.attr(&TTL, &attr),
            Err(e) => reply.error(e),
        }
    }

    fn mknod(&self, _req: &Request, parent: INodeNo, name: &OsStr, mode: u32, umask: u32, _rdev: u32, reply: ReplyEntry) {
        if mode & libc::S_IFMT != libc::S_IFREG {
            return reply.error(Errno::EPERM);
        }
        let parent = Self::ino(&self.disk(), parent);
        match self.create_file(parent, name, mode & !umask, libc::O_RDONLY) {
            Ok((attr, fh)) => {
                if let Some(fh) = fh {
                    self.handles.lock().unwrap().remove(&fh.0);
                }
                reply.entry(&TTL, &attr, Generation(0))
            }
            Err(e) => reply.error(e),
        }
    }

    fn mkdir(&self, _req: &Request, parent: INodeNo, name: &OsStr, mode: u32, umask: u32, reply: ReplyEntry) {
        let mut d = self.disk();
        let parent = Self::ino(&d, parent);
        let res = d.alive().and_then(|()| {
            let p = d.child(parent, Path::new(name))?;
            std::fs::create_dir(&p)?;
            std::fs::set_permissions(&p, std::fs::Permissions::from_mode(mode & !umask & 0o7777))?;
            d.created(parent, Path::new(name));
            let md = std::fs::symlink_metadata(&p)?;
            d.remember(parent, Path::new(name), md.ino());
            Ok(Self::attr(&d, &md))
        });
        match res {
            Ok(attr) => reply.entry(&TTL, &attr, Generation(0)),
            Err(e) => reply.error(errno(e)),
        }
    }

    fn unlink(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        self.remove(parent, name, false, reply);
    }

    fn rmdir(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        self.remove(parent, name, true, reply);
    }

    fn rename(
        &self,
        _req: &Request,
        parent: INodeNo,
        name: &OsStr,
        newparent: INodeNo,
        newname: &OsStr,
        flags: RenameFlags,
        reply: ReplyEmpty,
    ) {
        if flags.contains(RenameFlags::RENAME_EXCHANGE) || flags.contains(RenameFlags::RENAME_WHITEOUT) {
            return reply.error(Errno::EINVAL);
        }
        let mut d = self.disk();
        let (from, to) = (Self::ino(&d, parent), Self::ino(&d, newparent));
        let noreplace = flags.contains(RenameFlags::RENAME_NOREPLACE);
        match d.rename((from, Path::new(name)), (to, Path::new(newname)), noreplace) {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(errno(e)),
        }
    }

    fn open(&self, _req: &Request, ino: INodeNo, flags: OpenFlags, reply: ReplyOpen) {
        let d = self.disk();
        let ino = Self::ino(&d, ino);
        let res = d.alive().and_then(|()| backing_open(&d.path(ino).ok_or(io::ErrorKind::NotFound)?, flags.0));
        drop(d);
        match res {
            Ok(f) => reply.opened(self.add_handle(ino, f), FopenFlags::empty()),
            Err(e) => reply.error(errno(e)),
        }
    }

    fn read(
        &self,
        _req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        offset: u64,
        size: u32,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyData,
    ) {
        let d = self.disk();
        if d.crashed() {
            return reply.error(Errno::EIO);
        }
        let f = match self.handle(fh) {
            Ok((_, f)) => f,
            Err(e) => return reply.error(e),
        };
        let mut buf = vec![0u8; size as usize];
        let mut got = 0;
        while got < buf.len() {
            match f.read_at(&mut buf[got..], offset + got as u64) {
                Ok(0) => break,
                Ok(n) => got += n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return reply.error(errno(e)),
            }
        }
        reply.data(&buf[..got]);
    }

    fn write(
        &self,
        _req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        offset: u64,
        data: &[u8],
        _write_flags: WriteFlags,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyWrite,
    ) {
        let mut d = self.disk();
        let res = self.handle(fh).map_err(os_error).and_then(|(ino, f)| {
            d.before_write(ino, &f, offset, data.len() as u64)?;
            f.write_all_at(data, offset)
        });
        match res {
            Ok(()) => reply.written(data.len() as u32),
            Err(e) => reply.error(errno(e)),
        }
    }

    fn flush(&self, _req: &Request, _ino: INodeNo, _fh: FileHandle, _lock_owner: LockOwner, reply: ReplyEmpty) {
        reply.ok();
    }

    fn release(
        &self,
        _req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        _flush: bool,
        reply: ReplyEmpty,
    ) {
        self.handles.lock().unwrap().remove(&fh.0);
        reply.ok();
    }

    fn fsync(&self, _req: &Request, ino: INodeNo, _fh: FileHandle, _datasync: bool, reply: ReplyEmpty) {
        let mut d = self.disk();
        let ino = Self::ino(&d, ino);
        match d.sync_file(ino) {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(errno(e)),
        }
    }

    fn opendir(&self, _req: &Request, _ino: INodeNo, _flags: OpenFlags, reply: ReplyOpen) {
        if self.disk().crashed() {
            return reply.error(Errno::EIO);
        }
        reply.opened(FileHandle(0), FopenFlags::empty());
    }

    fn readdir(&self, _req: &Request, ino: INodeNo, _fh: FileHandle, offset: u64, mut reply: ReplyDirectory) {
        let d = self.disk();
        let bino = Self::ino(&d, ino);
        let res = d.alive().and_then(|()| {
            let p = d.path(bino).ok_or(io::ErrorKind::NotFound)?;
            let mut list = vec![(ino.0, FileType::Directory, OsStr::new(".").to_owned())];
            list.push((1, FileType::Directory, OsStr::new("..").to_owned()));
            for e in std::fs::read_dir(&p)? {
                let e = e?;
                if bino == d.root_ino() && e.file_name().as_bytes() == TRASH.as_bytes() {
                    continue;
                }
                let md = e.metadata()?;
                list.push((md.ino(), kind(&md), e.file_name()));
            }
            Ok(list)
        });
        match res {
            Ok(list) => {
                for (i, (ino, kind, name)) in list.into_iter().enumerate().skip(offset as usize) {
                    if reply.add(INodeNo(ino), (i + 1) as u64, kind, &name) {
                        break;
                    }
                }
                reply.ok()
            }
            Err(e) => reply.error(errno(e)),
        }
    }

    fn fsyncdir(&self, _req: &Request, ino: INodeNo, _fh: FileHandle, _datasync: bool, reply: ReplyEmpty) {
        let mut d = self.disk();
        let ino = Self::ino(&d, ino);
        match d.sync_dir(ino) {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(errno(e)),
        }
    }

    fn statfs(&self, _req: &Request, _ino: INodeNo, reply: ReplyStatfs) {
        let d = self.disk();
        let path = std::ffi::CString::new(d.root().as_os_str().as_bytes()).unwrap();
        // SAFETY: `path` is a valid C string and `st` a valid out-pointer for statvfs.
        let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
        if unsafe { libc::statvfs(path.as_ptr(), &mut st) } != 0 {
            return reply.error(errno(io::Error::last_os_error()));
        }
        reply.statfs(st.f_blocks, st.f_bfree, st.f_bavail, st.f_files, st.f_ffree, st.f_bsize as u32, 255, st.f_frsize as u32);
    }

    fn access(&self, _req: &Request, _ino: INodeNo, _mask: fuser::AccessFlags, reply: ReplyEmpty) {
        reply.ok();
    }

    fn create(&self, _req: &Request, parent: INodeNo, name: &OsStr, mode: u32, umask: u32, flags: i32, reply: ReplyCreate) {
        let parent = Self::ino(&self.disk(), parent);
        match self.create_file(parent, name, mode & !umask, flags) {
            Ok((attr, Some(fh))) => reply.created(&TTL, &attr, Generation(0), fh, FopenFlags::empty()),
            Ok((_, None)) => reply.error(Errno::EIO),
            Err(e) => reply.error(e),
        }
    }

    fn fallocate(&self, _req: &Request, _ino: INodeNo, fh: FileHandle, offset: u64, length: u64, mode: i32, reply: ReplyEmpty) {
        let mut d = self.disk();
        let res = self.handle(fh).map_err(os_error).and_then(|(ino, f)| {
            let len = f.metadata()?.len();
            let changes = libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_ZERO_RANGE;
            let shifts = libc::FALLOC_FL_COLLAPSE_RANGE | libc::FALLOC_FL_INSERT_RANGE;
            if mode & shifts != 0 {
                d.before_write(ino, &f, offset, u64::MAX - offset)?;
            } else if mode & changes != 0 {
                d.before_write(ino, &f, offset, length)?;
            } else if mode & libc::FALLOC_FL_KEEP_SIZE == 0 && offset + length > len {
                d.before_resize(ino, &f, offset + length)?;
            }
            use std::os::fd::AsRawFd;
            // SAFETY: a valid open descriptor and plain integer arguments.
            let r = unsafe { libc::fallocate(f.as_raw_fd(), mode, offset as i64, length as i64) };
            if r != 0 {
                return Err(io::Error::last_os_error());
            }
            Ok(())
        });
        match res {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(errno(e)),
        }
    }
}

/// An I/O error from a reply error.
fn os_error(e: Errno) -> io::Error {
    io::Error::from_raw_os_error(i32::from(e))
}
