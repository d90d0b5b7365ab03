//! Opening a shard: directory preparation, the IOPOLL-safe first DMA open,
//! and per-segment recovery (trusted sealed index, or a CRC scan that rebuilds
//! the index and truncates a torn tail).

use std::{
    collections::{BTreeMap, VecDeque},
    path::{Path, PathBuf},
    rc::Rc,
};

use glommio::io::{DmaFile, OpenOptions};

use crate::{
    error::{gio, StoreError},
    fault::Faults,
    format::{self, align_down, align_up, FileKind, Offset, Parse, ALIGN, FORMAT_FILE, RECORD_HEAD_BYTES, SEG_HEADER_BYTES},
    segment::{capacity_for, Segment},
    side,
    state::{new_inner, State},
    writer::Chunk,
    RecoveryReport, Shard, ShardConfig,
};

/// Bytes read per disk access while scanning a segment.
const SCAN_WINDOW: usize = 4 << 20;

/// Blocking part of `open`, run on glommio's blocking thread: creates the
/// directory and the `format` marker, lists segment files.
fn prepare_dir(dir: &Path) -> Result<Vec<String>, StoreError> {
    crate::create_dir_all_durable(dir).map_err(|e| StoreError::io("creating shard directory", dir, e))?;
    let marker = dir.join(FORMAT_FILE);
    match std::fs::read(&marker) {
        Ok(buf) => format::check_format_file(&buf).map_err(|reason| StoreError::Format { path: marker.clone(), reason })?,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            use std::io::Write;
            let tmp = dir.join("format.tmp");
            let mut f = std::fs::File::create(&tmp).map_err(|e| StoreError::io("creating", &tmp, e))?;
            f.write_all(&format::format_file_bytes()).map_err(|e| StoreError::io("writing", &tmp, e))?;
            f.sync_all().map_err(|e| StoreError::io("fsync", &tmp, e))?;
            std::fs::rename(&tmp, &marker).map_err(|e| StoreError::io("renaming", &marker, e))?;
            std::fs::File::open(dir).and_then(|d| d.sync_all()).map_err(|e| StoreError::io("fsync directory", dir, e))?;
        }
        Err(e) => return Err(StoreError::io("reading", &marker, e)),
    }
    let mut names = Vec::new();
    for ent in std::fs::read_dir(dir).map_err(|e| StoreError::io("listing", dir, e))? {
        let ent = ent.map_err(|e| StoreError::io("listing", dir, e))?;
        names.push(ent.file_name().to_string_lossy().into_owned());
    }
    drop_unwritten_segments(dir, &mut names);
    Ok(names)
}

/// A segment's `.seg` file is created (and preallocated) by the roll that starts it, before
/// the writer writes its header. A crash in between leaves a file whose header block is
/// still zeros; its records, and those of any later segment, were never synced (a sync
/// waits for every write cut before it, and a later segment's writes are cut after this
/// one's). The files of that segment and of every later one are removed, and the segment
/// before it is recovered as the last (its torn tail, if any, truncated). Only when it is
/// the first segment and its base is not 0 is it kept, as the empty last segment (its
/// header rewritten): its base is where the shard's offsets go on. (Removed, a first
/// segment at 0 needs no write to recover: the next roll creates it again.)
fn drop_unwritten_segments(dir: &Path, names: &mut Vec<String>) {
    use std::io::Read;
    let mut bases: Vec<Offset> =
        names.iter().filter_map(|n| format::parse_seg_name(n)).filter(|(_, k)| *k == FileKind::Seg).map(|(b, _)| b).collect();
    bases.sort_unstable();
    let unwritten = |base: Offset| {
        let mut head = [0u8; 8];
        match std::fs::File::open(format::seg_path(dir, base, FileKind::Seg)).and_then(|mut f| f.read(&mut head)) {
            Ok(n) => head[..n].iter().all(|&b| b == 0),
            Err(_) => false,
        }
    };
    let Some(k) = bases.iter().position(|&b| unwritten(b)) else { return };
    let from = if k == 0 && bases[0] != 0 { 1 } else { k };
    for &base in &bases[from..] {
        for kind in [FileKind::Seg, FileKind::Idx, FileKind::Del] {
            let p = format::seg_path(dir, base, kind);
            if std::fs::remove_file(&p).is_ok() {
                tracing::debug!(path = %p.display(), "removed a segment file after a never-written segment");
            }
            let name = p.file_name().map(|n| n.to_string_lossy().into_owned());
            names.retain(|n| Some(n) != name.as_ref());
        }
    }
}

/// Sequential window over a segment file (direct-I/O reads of `SCAN_WINDOW`).
struct SeqReader<'a> {
    file: &'a DmaFile,
    size: u64,
    buf: Vec<u8>,
    buf_pos: u64,
}

impl SeqReader<'_> {
    /// Makes `[pos, pos + len)` available as far as the file goes; returns the
    /// bytes available from `pos` (≤ `len`).
    async fn ensure(&mut self, pos: u64, len: usize) -> std::io::Result<usize> {
        let have_end = self.buf_pos + self.buf.len() as u64;
        if pos < self.buf_pos || pos >= have_end {
            self.buf.clear();
            self.buf_pos = align_down(pos);
        } else if pos - self.buf_pos >= SCAN_WINDOW as u64 {
            let cut = align_down(pos) - self.buf_pos;
            self.buf.drain(..cut as usize);
            self.buf_pos += cut;
        }
        let want_end = pos + len as u64;
        let mut guard = 0;
        while self.buf_pos + (self.buf.len() as u64) < want_end && self.buf_pos + (self.buf.len() as u64) < self.size && guard < 1 << 20 {
            guard += 1;
            let at = self.buf_pos + self.buf.len() as u64;
            let want = align_up((want_end - at).max(SCAN_WINDOW as u64)) as usize;
            let rr = self.file.read_at_aligned(at, want).await.map_err(gio)?;
            if rr.is_empty() {
                break;
            }
            self.buf.extend_from_slice(&rr);
            if rr.len() % ALIGN != 0 {
                break;
            }
        }
        let end = self.buf_pos + self.buf.len() as u64;
        Ok(end.saturating_sub(pos).min(len as u64) as usize)
    }

    fn slice(&self, pos: u64, len: usize) -> &[u8] {
        let a = (pos - self.buf_pos) as usize;
        &self.buf[a..a + len]
    }
}

/// Position of the first non-zero byte in `[from, to)` of the file, if any.
async fn first_nonzero(r: &mut SeqReader<'_>, from: u64, to: u64) -> std::io::Result<Option<u64>> {
    let mut at = from;
    for _ in 0..(to - from) / SCAN_WINDOW as u64 + 2 {
        if at >= to {
            break;
        }
        let want = (to - at).min(SCAN_WINDOW as u64) as usize;
        let got = r.ensure(at, want).await?;
        if got == 0 {
            break;
        }
        if let Some(i) = r.slice(at, got).iter().position(|&b| b != 0) {
            return Ok(Some(at + i as u64));
        }
        at += got as u64;
    }
    Ok(None)
}

struct Recovered {
    seg: Segment,
    tail: Vec<u8>,
    /// Live records lacking the flags `open` keeps (offsets, ascending), to be deleted.
    discard: Vec<Offset>,
}

fn warn(report: &mut RecoveryReport, msg: String) {
    tracing::warn!("{msg}");
    report.warnings.push(msg);
}

fn drop_range(report: &mut RecoveryReport, from: Offset, to: Offset, why: String) {
    tracing::error!(from, to, "dropped records: {why}");
    report.dropped.push((from, to, why));
}

/// Where recovery reads a segment from.
struct SegmentAt<'a> {
    dir: &'a Path,
    base: Offset,
    /// The newest segment (takes appends after open).
    last: bool,
    /// Bound on its records (the next segment's base minus its own).
    max_count: u64,
}

/// Recovers one segment. With `keep`, also lists its live records whose flags byte lacks
/// a bit of `keep` (`Recovered::discard`): read during the scan of an unsealed segment; for
/// a sealed one, from the record heads (not CRC-checked unless `verify_on_open`), unless
/// its seal says every record has them.
async fn recover_segment(
    at: SegmentAt<'_>,
    keep: Option<u8>,
    cfg: &ShardConfig,
    report: &mut RecoveryReport,
) -> Result<Recovered, StoreError> {
    let SegmentAt { dir, base, last, max_count } = at;
    let mut discard = Vec::new();
    let lacks = |flags: u8| keep.is_some_and(|k| flags & k != k);
    let sp = format::seg_path(dir, base, FileKind::Seg);
    let ip = format::seg_path(dir, base, FileKind::Idx);
    let dp = format::seg_path(dir, base, FileKind::Del);
    let file = OpenOptions::new().read(true).write(true).dma_open(&sp).await.map_err(|e| StoreError::io("opening segment", &sp, gio(e)))?;
    let size = file.file_size().await.map_err(|e| StoreError::io("stat segment", &sp, gio(e)))?;
    let size_cap = capacity_for(size.max(SEG_HEADER_BYTES as u64)).max(capacity_for(cfg.segment_bytes));

    let idx_opened = side::open(&ip, true, base);
    let seal = match &idx_opened {
        Ok((m, _)) => side::idx_seal(m).filter(|&(count, end)| count <= max_count && end <= size),
        Err(_) => None,
    };
    let trusted = !last && seal.is_some();
    let (mut idx, idx_cap) = match idx_opened {
        Ok((m, cap)) if trusted || cap >= size_cap => (m, cap),
        _ => (side::create(&ip, true, base, size_cap, size_cap).map_err(|e| StoreError::io("creating index", &ip, e))?, size_cap),
    };
    let mut del = match side::open(&dp, false, base) {
        Ok((m, cap)) if cap >= idx_cap => m,
        Ok((m, cap)) => {
            // Sized for fewer records than the file could hold (a segment that
            // grew past `segment_bytes` for one large record, or an older
            // config): carry its bits over to a bitmap of the needed size.
            // Written beside it, flushed, then renamed over it: a crash on
            // the way leaves the old bitmap (the next open does this again).
            let tmp = dp.with_extension("del.tmp");
            let mut new = side::create(&tmp, false, base, idx_cap, cap).map_err(|e| StoreError::io("creating deletion bitmap", &tmp, e))?;
            for k in (0..cap).filter(|&k| side::bit_get(&m, k)) {
                side::bit_set(&mut new, k);
            }
            drop(m);
            new.flush().map_err(|e| StoreError::io("flushing deletion bitmap", &tmp, e))?;
            std::fs::rename(&tmp, &dp).map_err(|e| StoreError::io("renaming deletion bitmap", &dp, e))?;
            new
        }
        Err(why) => {
            warn(report, format!("deletion bitmap {} unusable ({why}): records of segment {base} are treated as live", dp.display()));
            side::create(&dp, false, base, idx_cap, idx_cap).map_err(|e| StoreError::io("creating deletion bitmap", &dp, e))?
        }
    };

    let mut r = SeqReader { file: &file, size, buf: Vec::new(), buf_pos: 0 };
    let mut seg_size = size;
    let (count, data_end);
    let mut flags_all = 0xffu8;
    if let (true, Some((c, end))) = (trusted, seal) {
        count = c;
        data_end = end;
        let summary = side::idx_flags_all(&idx);
        flags_all = summary.unwrap_or(0);
        // Records to discard can only be here if the seal does not rule them out.
        let sift = keep.is_some() && summary.is_none_or(lacks);
        if cfg.verify_on_open || sift {
            for k in 0..count {
                if side::bit_get(&del, k) {
                    continue;
                }
                let pos = side::idx_get(&idx, k);
                let end = if k + 1 < count { side::idx_get(&idx, k + 1) } else { data_end };
                let len = end.saturating_sub(pos) as usize;
                if !cfg.verify_on_open {
                    // The head only: its flags byte, the body is not read (a record whose
                    // head does not match its index entry is kept, and checked when read).
                    let want = len.min(RECORD_HEAD_BYTES);
                    let got = r.ensure(pos, want).await.map_err(|e| StoreError::io("reading segment", &sp, e))?;
                    let head = format::parse_record_head(r.slice(pos, got));
                    if head.is_some_and(|(l, o, flags)| l == len && o == base + k && lacks(flags)) {
                        discard.push(base + k);
                    }
                    continue;
                }
                let got = r.ensure(pos, len).await.map_err(|e| StoreError::io("reading segment", &sp, e))?;
                let why = if got < len {
                    Some(format!("record at byte {pos} is cut short by the end of the file"))
                } else {
                    match format::parse_record(r.slice(pos, len)) {
                        Parse::Record(rec) if rec.offset == base + k && rec.len == len => {
                            if lacks(rec.flags) {
                                discard.push(base + k);
                            }
                            None
                        }
                        Parse::Record(rec) => Some(format!("record at byte {pos} has offset {}, expected {}", rec.offset, base + k)),
                        Parse::Bad(w) => Some(format!("{w} at byte {pos}")),
                        Parse::End | Parse::Short { .. } => Some(format!("no record at byte {pos}")),
                    }
                };
                if let Some(why) = why {
                    side::bit_set(&mut del, k);
                    drop_range(report, base + k, base + k + 1, format!("corrupt record in sealed segment {}: {why}", sp.display()));
                }
            }
        }
    } else {
        // Scan: check the header, then every record, rebuilding the index.
        let mut pos = SEG_HEADER_BYTES as u64;
        let mut n = 0u64;
        let got = r.ensure(0, SEG_HEADER_BYTES).await.map_err(|e| StoreError::io("reading segment", &sp, e))?;
        let header_ok = got == SEG_HEADER_BYTES
            && match format::decode_seg_header(r.slice(0, SEG_HEADER_BYTES)) {
                Ok(b) if b == base => true,
                Ok(b) => {
                    warn(report, format!("{}: header names base {b}; the file name wins", sp.display()));
                    false
                }
                Err(why) => {
                    if size > 0 {
                        warn(report, format!("{}: {why}; header rewritten", sp.display()));
                    }
                    false
                }
            };
        let mut stop: Option<String> = None;
        for _ in 0..u32::MAX {
            if n >= max_count.min(idx_cap) {
                if pos < size {
                    stop = Some(format!("records past offset {} overlap the next segment", base + n));
                }
                break;
            }
            let avail = r.ensure(pos, RECORD_HEAD_BYTES).await.map_err(|e| StoreError::io("reading segment", &sp, e))?;
            if avail == 0 {
                break;
            }
            let mut bytes = r.slice(pos, avail);
            if avail >= 4 {
                let len = u32::from_le_bytes(bytes[0..4].try_into().unwrap()) as usize;
                if (RECORD_HEAD_BYTES..=format::MAX_RECORD_BYTES).contains(&len) && len > avail {
                    let got = r.ensure(pos, len).await.map_err(|e| StoreError::io("reading segment", &sp, e))?;
                    bytes = r.slice(pos, got);
                }
            }
            match format::parse_record(bytes) {
                Parse::Record(rec) if rec.offset == base + n => {
                    side::idx_put(&mut idx, n, pos);
                    flags_all &= rec.flags;
                    if lacks(rec.flags) && !side::bit_get(&del, n) {
                        discard.push(base + n);
                    }
                    n += 1;
                    pos += rec.len as u64;
                }
                Parse::Record(rec) => {
                    stop = Some(format!("record at byte {pos} has offset {}, expected {}", rec.offset, base + n));
                    break;
                }
                Parse::End => break,
                Parse::Short { need } => {
                    stop = Some(format!("record at byte {pos} needs {need} bytes, the file ends first"));
                    break;
                }
                Parse::Bad(why) => {
                    stop = Some(format!("{why} at byte {pos}"));
                    break;
                }
            }
        }
        count = n;
        data_end = pos;
        // ringmq leaves every segment file a whole number of blocks (preallocated, and
        // truncated only to a block boundary): records running to an end that is not one
        // mean the file was cut, and whatever followed them is lost.
        if stop.is_none() && data_end >= size && !size.is_multiple_of(ALIGN as u64) {
            stop = Some(format!("the file ends at byte {size}, not on a {ALIGN}-byte boundary: it was cut short"));
        }
        // Records appended before the crash that are not in the file: for the last
        // segment, those its index lists past the data; for an earlier one, up to the
        // next segment's base.
        let unwritten = if last { side::idx_listed_past(&idx, n, pos, idx_cap) } else { max_count - n };
        // Segment files are preallocated: zeros after the records are the end
        // of the log, anything else there is the rest of a torn write.
        let mut tail_clean = true;
        if stop.is_none() && size > data_end {
            if let Some(at) = first_nonzero(&mut r, data_end, size).await.map_err(|e| StoreError::io("reading segment", &sp, e))? {
                tail_clean = false;
                stop = Some(format!("non-zero bytes at byte {at}, after the end of the records"));
            }
        } else if stop.is_some() {
            tail_clean = false;
        }
        if let Some(why) = stop {
            if last {
                drop_range(
                    report,
                    base + count,
                    base + count + unwritten.max(1),
                    format!("torn tail of {} truncated at byte {data_end}: {why}", sp.display()),
                );
            } else if base + count < base + max_count {
                drop_range(
                    report,
                    base + count,
                    base + max_count,
                    format!("segment {} unreadable after byte {data_end}: {why}", sp.display()),
                );
            }
        } else if unwritten > 0 {
            // Zeros (or the end of the file) where records were: what a crash leaves of
            // appends it cut before their write or their sync (a publisher confirm waits
            // for the sync), or what a disk lost. Said once: the last segment's index
            // entries go, an earlier segment is sealed with what it holds.
            warn(
                report,
                format!(
                    "{}: offsets {}..{} were appended before the crash but are not in the file (nothing from byte {data_end} on): never synced, so never confirmed, or lost by the disk",
                    sp.display(),
                    base + count,
                    base + count + unwritten
                ),
            );
        }
        if last && unwritten > 0 {
            side::idx_clear(&mut idx, count, unwritten);
        }
        if !header_ok || (last && (!tail_clean || size < align_up(data_end))) {
            // Repair: header block and a clean, zero-padded tail; then make it durable.
            if !header_ok {
                let mut b = file.alloc_dma_buffer(SEG_HEADER_BYTES);
                format::encode_seg_header(base, cfg.segment_bytes, b.as_bytes_mut());
                file.write_at(b, 0).await.map_err(|e| StoreError::io("rewriting segment header", &sp, gio(e)))?;
            }
            if last {
                let tail_at = align_down(data_end);
                let tail_len = (data_end - tail_at) as usize;
                if tail_len > 0 {
                    r.ensure(tail_at, tail_len).await.map_err(|e| StoreError::io("reading segment", &sp, e))?;
                    let mut b = file.alloc_dma_buffer(ALIGN);
                    b.as_bytes_mut().fill(0);
                    b.as_bytes_mut()[..tail_len].copy_from_slice(r.slice(tail_at, tail_len));
                    file.write_at(b, tail_at).await.map_err(|e| StoreError::io("rewriting segment tail", &sp, gio(e)))?;
                }
                file.truncate(align_up(data_end)).await.map_err(|e| StoreError::io("truncating segment", &sp, gio(e)))?;
                seg_size = align_up(data_end);
            }
        }
        if last {
            // The writer preallocates ahead of its next writes (see `preallocate_ahead`).
            file.fdatasync().await.map_err(|e| StoreError::io("fdatasync", &sp, gio(e)))?;
        }
    }
    // Side-file pages of the records there are (and, for the last segment, of the next
    // one): already allocated when this version wrote them, so on a full disk this costs
    // nothing; an older version's sparse pages are allocated now. If that fails, appends
    // and deletes allocate what they touch themselves (crate::space).
    let want = if last { (count + 2).min(idx_cap) } else { count };
    let reserved = match (side::reserve(&ip, true, 0, want, idx_cap), side::reserve(&dp, false, 0, want, idx_cap)) {
        (Ok(()), Ok(())) => want,
        (Err(e), _) | (_, Err(e)) => {
            tracing::warn!(segment = %sp.display(), error = %e, "side-file pages not allocated at open");
            0
        }
    };
    if last {
        side::bits_clear_from(&mut del, &dp, count, idx_cap);
    }
    let deleted = side::bits_count(&del, count);
    let tail = if last {
        let at = align_down(data_end);
        let n = (data_end - at) as usize;
        if n > 0 {
            r.ensure(at, n).await.map_err(|e| StoreError::io("reading segment", &sp, e))?;
            r.slice(at, n).to_vec()
        } else {
            Vec::new()
        }
    } else {
        Vec::new()
    };
    drop(r);
    report.records += count - deleted;
    report.deleted += deleted;
    Ok(Recovered {
        seg: Segment {
            base,
            capacity: idx_cap,
            count,
            live: count - deleted,
            data_end,
            idx,
            del,
            file: Some(Rc::new(file)),
            placeholder: None,
            reserved,
            seg_room: seg_size,
            full: !last || trusted,
            sealed: trusted,
            del_dirty: false,
            flags_all,
        },
        tail,
        discard,
    })
}

/// Opens and recovers the shard in `dir`. With `keep`, every live record whose flags byte
/// lacks a bit of `keep` is deleted (its bitmap bit set; durable by the next full sync,
/// which [`Shard::open_retaining`] runs) and counted in `RecoveryReport::discarded`.
pub(crate) async fn open(
    dir: &Path,
    cfg: ShardConfig,
    faults: Option<Faults>,
    keep: Option<u8>,
) -> Result<(Shard, RecoveryReport), StoreError> {
    cfg.validate()?;
    let dir: PathBuf = dir.to_path_buf();
    let d2 = dir.clone();
    let names = glommio::executor().spawn_blocking(move || prepare_dir(&d2)).await?;
    // The IOPOLL trap: the first DMA open on a device probes polled I/O with a
    // read at byte 0. Open the non-empty marker first so the probe really reads.
    let marker = dir.join(FORMAT_FILE);
    let injected = |op: &'static str, path: &Path| match faults.as_ref().and_then(|f| f.hit(crate::FaultPoint::Open)) {
        Some(a) => Err(StoreError::io(op, path, a.error())),
        None => Ok(()),
    };
    injected("opening", &marker)?;
    let probe = DmaFile::open(&marker).await.map_err(|e| StoreError::io("opening", &marker, gio(e)))?;
    let (alloc, spare) = crate::space::thread_allocator(probe);
    if let Some(f) = spare {
        let _ = f.close().await;
    }
    let mut files: BTreeMap<Offset, [bool; 3]> = BTreeMap::new();
    let mut report = RecoveryReport::default();
    for name in &names {
        if let Some((base, kind)) = format::parse_seg_name(name) {
            let e = files.entry(base).or_default();
            e[kind as usize] = true;
        } else if name.ends_with(".tmp") {
            let _ = std::fs::remove_file(dir.join(name));
        }
    }
    let mut bases = Vec::new();
    for (&base, has) in &files {
        if has[FileKind::Seg as usize] {
            bases.push(base);
        } else {
            for kind in [FileKind::Idx, FileKind::Del] {
                if has[kind as usize] {
                    let p = format::seg_path(&dir, base, kind);
                    let _ = std::fs::remove_file(&p);
                    tracing::debug!(path = %p.display(), "removed side file of a segment that does not exist");
                }
            }
        }
    }
    let mut segs = VecDeque::new();
    let mut tail = Vec::new();
    let mut discard = Vec::new();
    for (k, &base) in bases.iter().enumerate() {
        let last = k + 1 == bases.len();
        let max_count = bases.get(k + 1).map(|&nb| nb - base).unwrap_or(u64::MAX);
        injected("opening segment", &format::seg_path(&dir, base, FileKind::Seg))?;
        let at = SegmentAt { dir: &dir, base, last, max_count };
        let mut rec = recover_segment(at, keep, &cfg, &mut report).await?;
        if last {
            tail = rec.tail;
        }
        discard.append(&mut rec.discard);
        segs.push_back(rec.seg);
    }
    let next_offset = segs.back().map(|s| s.base + s.count).unwrap_or(0);
    let mut st = State::new(next_offset, segs, cfg.cache_bytes, alloc);
    discard_records(&mut st, &dir, &discard, &mut report);
    if let Some((full, base, data_end)) = st.segs.back().map(|s| (s.full, s.base, s.data_end)) {
        if !full {
            let mut buf = st.alloc_first_chunk();
            buf.as_bytes_mut()[..tail.len()].copy_from_slice(&tail);
            st.chunk = Some(Chunk { seg_base: base, pos: align_down(data_end), buf, fill: tail.len(), clean: tail.len(), create: false });
        }
    }
    if !report.dropped.is_empty() || !report.warnings.is_empty() {
        tracing::warn!(dir = %dir.display(), dropped = report.dropped.len(), warnings = report.warnings.len(), "shard recovered with losses");
    }
    tracing::debug!(
        dir = %dir.display(),
        records = report.records,
        deleted = report.deleted,
        discarded = report.discarded,
        next_offset,
        "shard opened"
    );
    let inner = new_inner(st, dir, cfg, faults);
    Ok((Shard::from_parts(inner), report))
}

/// Deletes the records `open` was asked not to keep (`offsets` ascending), as
/// [`Shard::delete_by_offsets`] would: bitmap bits, live counts, and a delete epoch for the
/// next full sync to make durable (a crash before it brings them back, and the next open
/// discards them again). A bitmap page that cannot be allocated (a full disk, a segment of
/// an older version) leaves its records live, with a warning.
fn discard_records(st: &mut State, dir: &Path, offsets: &[Offset], report: &mut RecoveryReport) {
    let mut hint = 0;
    let mut discarded = 0u64;
    let mut failed = None;
    for &o in offsets {
        match st.delete_one(dir, o, &mut hint) {
            Ok(true) => discarded += 1,
            Ok(false) => {}
            Err(e) => failed = Some(e),
        }
    }
    if let Some(e) = failed {
        warn(report, format!("records that open was asked to discard stay live: {e}"));
    }
    if discarded > 0 {
        st.del_epoch += 1;
    }
    report.records -= discarded;
    report.discarded += discarded;
}
