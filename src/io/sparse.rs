//! A file written front to back in which every whole page of zeros
//! (4 KiB, aligned in the file) is left a hole, as `cp --sparse=auto` and
//! `tar -S` leave them: an unpacked process's zero pages (a dump elides
//! them; CRIU reads them back from the images) and a packed sparse file
//! cost no disk. A hole reads as zeros, so the bytes are the same. Runs of
//! data pages go to the file as one write each, so whole decoded blocks
//! still pass the buffer by.

use crate::codec::is_zero_page;
use crate::format::PAGE_SIZE;
use std::fs::File;
use std::io::{BufWriter, Seek, SeekFrom, Write};

const PAGE: u64 = PAGE_SIZE as u64;

pub struct SparseFile {
    w: BufWriter<File>,
    /// Where the next write lands in the file (behind `len` after a hole).
    at: u64,
    /// Bytes of the file so far, holes included.
    len: u64,
}

impl SparseFile {
    /// Writes through a buffer of `buffer` bytes.
    pub fn new(file: File, buffer: usize) -> Self {
        SparseFile { w: BufWriter::with_capacity(buffer, file), at: 0, len: 0 }
    }

    pub fn write_all(&mut self, mut data: &[u8]) -> std::io::Result<()> {
        while !data.is_empty() {
            // Data up to the first whole zero page, then the zero pages.
            let (kept, zeros) = split_at_zero_pages(data, self.len);
            if !kept.is_empty() {
                if self.at != self.len {
                    self.w.seek(SeekFrom::Start(self.len))?;
                }
                self.w.write_all(kept)?;
                self.len += kept.len() as u64;
                self.at = self.len;
            }
            self.len += zeros as u64;
            data = &data[kept.len() + zeros..];
        }
        Ok(())
    }

    /// The file, whole: a hole at its end is given its length.
    pub fn finish(self) -> std::io::Result<File> {
        let file = self.w.into_inner().map_err(|e| e.into_error())?;
        if self.at != self.len {
            file.set_len(self.len)?;
        }
        Ok(file)
    }
}

/// `data`, landing at file offset `offset`, split into the bytes before its
/// first whole aligned zero page and the number of zero bytes (whole pages)
/// that follow them.
fn split_at_zero_pages(data: &[u8], offset: u64) -> (&[u8], usize) {
    let to_boundary = ((PAGE - offset % PAGE) % PAGE) as usize;
    let mut kept = to_boundary.min(data.len());
    let pages = |from: usize| data[from..].chunks_exact(PAGE_SIZE);
    kept += pages(kept).take_while(|p| !is_zero_page(p)).count() * PAGE_SIZE;
    let zeros = pages(kept).take_while(|p| is_zero_page(p)).count() * PAGE_SIZE;
    if zeros == 0 {
        // No whole zero page: the rest (a short tail included) is data.
        return (data, 0);
    }
    (&data[..kept], zeros)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Read;
    use std::os::unix::fs::MetadataExt;

    fn page(b: u8) -> Vec<u8> {
        vec![b; PAGE_SIZE]
    }

    /// Writes `pieces` in turn; returns the bytes read back and the bytes
    /// the file takes on disk.
    fn written(pieces: &[Vec<u8>]) -> (Vec<u8>, u64) {
        let f = tempfile::tempfile().unwrap();
        let mut s = SparseFile::new(f, 64 << 10);
        for p in pieces {
            s.write_all(p).unwrap();
        }
        let mut f = s.finish().unwrap();
        let disk = f.metadata().unwrap().blocks() * 512;
        let mut back = Vec::new();
        f.rewind().unwrap();
        f.read_to_end(&mut back).unwrap();
        (back, disk)
    }

    #[test]
    fn zero_pages_become_holes_and_read_back_as_written() {
        let cases: Vec<Vec<Vec<u8>>> = vec![
            vec![[page(0), page(0), page(0)].concat()],
            vec![[page(1), page(0), page(0), page(2)].concat(), page(0)],
            vec![vec![0; 100], page(0), vec![7; 10], [page(0), page(0)].concat(), vec![0; 5]],
            vec![[vec![3; 4000], page(0), page(0), vec![0; 96]].concat(), page(0)],
            vec![vec![], page(0), vec![]],
        ];
        for pieces in cases {
            let all = pieces.concat();
            let (back, _) = written(&pieces);
            assert_eq!(back, all);
        }
        let (_, disk) = written(&[vec![0; 64 << 20]]);
        assert!(disk < 1 << 20, "64 MiB of zeros took {disk} bytes of disk");
        let (back, disk) = written(&[[page(9), vec![0; 32 << 20], page(9)].concat()]);
        assert_eq!(back.len(), (32 << 20) + 2 * PAGE_SIZE);
        assert!(disk < 1 << 20, "took {disk} bytes of disk");
    }

    #[test]
    fn a_page_is_zero_only_when_aligned_in_the_file() {
        // 100 bytes in, a page of zeros spans two file pages: data.
        assert_eq!(split_at_zero_pages(&page(0), 100), (&page(0)[..], 0));
        let d = [vec![5; 10], page(0), page(0)].concat();
        assert_eq!(split_at_zero_pages(&d, PAGE - 10), (&d[..10], 2 * PAGE_SIZE));
    }
}
