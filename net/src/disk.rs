//! Files written for durability without waiting for the disk at the end.

use std::fs::File;

/// Starts writing `len` bytes of `f` from `from` to the disk without waiting for them (Linux's
/// `sync_file_range`; nothing elsewhere), so that the fsync that makes the file durable finds
/// most of it written: a 57 MB file's fsync waited 27 ms for all of it on the 2-core VM's
/// disk. The caller does the writeback's work (about 0.1 ms for 256 KiB there), so a task
/// whose latency matters should not call it for every small write. Best effort: an error here
/// is left for the fsync to report.
#[allow(unsafe_code)]
fn start_writeback(f: &File, from: u64, len: u64) {
    #[cfg(target_os = "linux")]
    {
        use std::os::fd::AsRawFd;
        let (Ok(from), Ok(len)) = (i64::try_from(from), i64::try_from(len)) else {
            return;
        };
        // SAFETY: `f` is an open file for the whole call, which only reads its arguments.
        unsafe {
            libc::sync_file_range(f.as_raw_fd(), from, len, libc::SYNC_FILE_RANGE_WRITE);
        }
    }
    #[cfg(not(target_os = "linux"))]
    let _ = (f, from, len);
}

/// Bytes a file gathers between two writebacks started by [`Writeback`].
pub const WRITEBACK_BYTES: u64 = 4 << 20;

/// Starts a file's writeback every [`WRITEBACK_BYTES`] as it is written in order.
#[derive(Debug, Default, Clone)]
pub struct Writeback {
    /// Where the bytes not yet handed to writeback start.
    from: u64,
}

impl Writeback {
    /// Notes that `f` now holds its bytes up to `end`, and starts their writeback once
    /// [`WRITEBACK_BYTES`] of them wait.
    pub fn wrote(&mut self, f: &File, end: u64) {
        if end >= self.from.saturating_add(WRITEBACK_BYTES) {
            start_writeback(f, self.from, end - self.from);
            self.from = end;
        }
    }

    /// [`Writeback::wrote`] for a file written from its start through `w`, `written` bytes so
    /// far: the file holds them less what `w` still buffers.
    pub fn wrote_through(&mut self, w: &std::io::BufWriter<File>, written: u64) {
        self.wrote(w.get_ref(), written - w.buffer().len() as u64);
    }
}

/// Starts files' writeback on a thread of its own: for files written out of order, a piece at
/// a time, by a task whose latency matters (the aggregator's chunk task), so that neither it
/// nor the fsync that makes a file durable waits for the disk. The thread ends when this is
/// dropped.
#[derive(Debug)]
pub struct Flusher {
    tx: std::sync::mpsc::Sender<(std::sync::Arc<File>, u64, u64)>,
}

impl Flusher {
    /// Starts the thread.
    pub fn start() -> std::io::Result<Flusher> {
        let (tx, rx) = std::sync::mpsc::channel::<(std::sync::Arc<File>, u64, u64)>();
        std::thread::Builder::new()
            .name("writeback".into())
            .spawn(move || {
                for (f, from, len) in rx {
                    start_writeback(&f, from, len);
                }
            })?;
        Ok(Flusher { tx })
    }

    /// Starts the writeback of what `f` holds from `from` for `len` bytes, soon.
    pub fn flush(&self, f: &std::sync::Arc<File>, from: u64, len: u64) {
        let _ = self.tx.send((f.clone(), from, len));
    }
}

/// A buffered writer to a file written from its start, which starts the writeback of what it
/// has passed to the file every [`WRITEBACK_BYTES`].
#[derive(Debug)]
pub struct WritingBack<'a> {
    w: &'a mut std::io::BufWriter<File>,
    /// Bytes written through this.
    len: u64,
    mark: Writeback,
}

impl<'a> WritingBack<'a> {
    /// Writes through `w`, whose file is empty.
    pub fn new(w: &'a mut std::io::BufWriter<File>) -> Self {
        WritingBack {
            w,
            len: 0,
            mark: Writeback::default(),
        }
    }

    /// Bytes written so far: where the next one lands in the file.
    pub fn position(&self) -> u64 {
        self.len
    }
}

impl std::io::Write for WritingBack<'_> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let n = self.w.write(buf)?;
        self.len += n as u64;
        self.mark.wrote_through(self.w, self.len);
        Ok(n)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.w.flush()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Write};

    #[test]
    fn writeback_leaves_the_bytes_as_written_whatever_the_range() {
        let dir = std::env::temp_dir().join(format!("unifed-writeback-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join("f");
        let mut f = File::create(&p).unwrap();
        let bytes: Vec<u8> = (0..1 << 20).map(|i| (i % 251) as u8).collect();
        f.write_all(&bytes).unwrap();
        // In range, past the end, and too far for the system's offsets: none disturbs the file.
        for (from, len) in [(0, 4096), (4096, 1 << 20), (2 << 20, 10), (u64::MAX, 1)] {
            start_writeback(&f, from, len);
        }
        f.sync_all().unwrap();
        let mut back = Vec::new();
        File::open(&p).unwrap().read_to_end(&mut back).unwrap();
        assert_eq!(back, bytes);
        // Written through the buffered writer in odd pieces, the file is the bytes in order.
        let mut w = std::io::BufWriter::with_capacity(1000, File::create(&p).unwrap());
        let mut through = WritingBack::new(&mut w);
        let big: Vec<u8> = (0..(WRITEBACK_BYTES as usize * 2 + 777))
            .map(|i| (i % 253) as u8)
            .collect();
        for piece in big.chunks(4099) {
            through.write_all(piece).unwrap();
        }
        assert_eq!(through.position(), big.len() as u64);
        through.flush().unwrap();
        drop(w);
        back.clear();
        File::open(&p).unwrap().read_to_end(&mut back).unwrap();
        assert!(back == big, "the file differs from what was written");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
