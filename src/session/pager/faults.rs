//! Answering faults: each waiting fault gets the rest of its block still
//! missing (one decode, up to a block of pages), private memory by address,
//! served shared memory by its offset in the object; a fault where nothing
//! is missing (a zero page, a page another thread's fault brought) gets
//! the zero page or a wake-up.

use super::space::{missing_at, take_range, View};
use super::{Pager, Step, PAGE, TOUCHED_MAX};
use crate::codec;
use crate::criu::uffd::{Copied, CopiedAll};
use crate::error::{Error, Result, ResultContext};
use crate::format::PAGE_SIZE;
use crate::session::place::ZeroPages;

/// A fault in served shared memory: the view it hit, the offset it shows
/// there, and the object's missing range holding that offset.
type SharedAt = (View, u64, (u64, u64, u64));

impl<'a> Pager<'a> {
    pub(super) fn serve_faults(&mut self) -> Result<()> {
        while let Some((i, addr)) = self.faults.pop_front() {
            let s = &self.spaces[i];
            let shared = self.shared_missing_at(i, addr);
            let private = s.missing_at(addr);
            if private.is_some() || shared.is_some() {
                self.report.faults += 1;
                if self.report.touched.len() < TOUCHED_MAX {
                    self.report.touched.push((s.pid, addr));
                }
            }
            let step = match (private, shared) {
                (Some(range), _) => self.put_block_around(i, addr, range)?,
                (None, Some(at)) => self.put_shared_block_around(i, at)?,
                // Not lazy (a zero page, a hole of shared memory), or
                // already copied for another thread's fault: the zero page
                // (a page of zeros in shared memory), or a wake-up.
                (None, None) => match s.uffd.zero_page(addr, PAGE).map_err(|e| self.uffd_failed(i, e))? {
                    Copied::Changing => Step::Changing,
                    _ => Step::Done,
                },
            };
            if let Step::Changing = step {
                self.faults.push_front((i, addr));
                return Ok(());
            }
        }
        Ok(())
    }

    /// Copies the missing rest of the block that holds `addr`, which lies in
    /// the missing range `(start, end, page)`.
    pub(super) fn put_block_around(
        &mut self,
        i: usize,
        addr: u64,
        (start, end, page): (u64, u64, u64),
    ) -> Result<Step> {
        let at = page + (addr - start) / PAGE;
        let (block, first) = self.block(i, at, false)?;
        let before = (at * PAGE - first) / PAGE;
        let after = (block.len() as u64 - (at * PAGE - first)) / PAGE;
        // Saturating: a crafted pagemap could put a page lower than the
        // pages before it in its block would reach (CRIU's never do).
        let from = start.max(addr.saturating_sub(before * PAGE));
        let to = end.min(addr + after * PAGE);
        let off = (at * PAGE - first) as usize - (addr - from) as usize;
        self.put(i, from, &block[off..off + (to - from) as usize])
    }

    /// Where `addr` of space `i` shows a page of served shared memory not in
    /// yet.
    pub(super) fn shared_missing_at(&self, i: usize, addr: u64) -> Option<SharedAt> {
        let (v, offset) = self.spaces[i].view_at(addr)?;
        Some((v, offset, missing_at(&self.served[v.object].missing, offset)?))
    }

    /// Copies the missing rest of the block of served shared memory that
    /// holds `offset`, which view `v` of space `i` shows, and which lies in
    /// the object's missing range `(start, end, page)`: as far as the view
    /// shows it.
    pub(super) fn put_shared_block_around(
        &mut self,
        i: usize,
        (v, offset, (start, end, page)): SharedAt,
    ) -> Result<Step> {
        let file = self.served[v.object].pages_file;
        let at = page + (offset - start) / PAGE;
        let label = self.blocks.source.label();
        let pid = self.spaces[i].pid;
        let (block, first) = self
            .blocks
            .block_at(&mut self.dec, file, at, false)
            .context(|| format!("{label}: shared memory of restored process {pid}"))?;
        let before = (at * PAGE - first) / PAGE;
        let after = (block.len() as u64 - (at * PAGE - first)) / PAGE;
        let from = start.max(offset.saturating_sub(before * PAGE)).max(v.pgoff);
        let to = end.min(offset + after * PAGE).min(v.pgend());
        let skip = (at * PAGE - first - (offset - from)) as usize;
        let data = &block[skip..skip + (to - from) as usize];
        let dst = v.start + (from - v.pgoff);
        let got = self.spaces[i].uffd.copy_all(dst, data).map_err(|e| self.uffd_failed(i, e))?;
        let (done, pages, step) = match got {
            CopiedAll::Done { pages, .. } => (to - from, pages, Step::Done),
            CopiedAll::Changing { done, pages, .. } => (done, pages, Step::Changing),
            CopiedAll::Gone => {
                self.ended(i)?;
                return Ok(Step::Done);
            }
        };
        self.report.pages += pages;
        self.report.shared_pages += pages;
        take_range(&mut self.served[v.object].missing, from, from + done);
        Ok(step)
    }

    pub(super) fn block(&mut self, i: usize, page: u64, fill: bool) -> Result<(std::sync::Arc<Vec<u8>>, u64)> {
        let s = &self.spaces[i];
        let label = self.blocks.source.label();
        self.blocks
            .block_at(&mut self.dec, s.file, page, fill)
            .context(|| format!("{label}: pages of restored process {}", s.pid))
    }

    pub(super) fn uffd_failed(&self, i: usize, err: std::io::Error) -> Error {
        Error::CriuIo { what: format!("userfaultfd of restored process {}", self.spaces[i].pid), err }
    }

    /// Copies `data` to `dst` in space `i` (skipping pages already there or
    /// no longer registered) and marks it all in place. Its zero pages are
    /// mapped where [`ZeroPages::Map`] says so: the data is a decoded,
    /// checked block, so a page that reads as zero there is one.
    pub(super) fn put(&mut self, i: usize, dst: u64, data: &[u8]) -> Result<Step> {
        let uffd = &self.spaces[i].uffd;
        let got = match self.zeros {
            ZeroPages::Map => {
                uffd.copy_all_mapping_zeros(dst, data, |p| codec::is_zero_page(&data[p * PAGE_SIZE..][..PAGE_SIZE]))
            }
            ZeroPages::Copy => uffd.copy_all(dst, data),
        };
        match got.map_err(|e| self.uffd_failed(i, e))? {
            CopiedAll::Done { pages, zeros } => {
                self.report.pages += pages;
                self.report.zero_pages += zeros;
                self.spaces[i].drop_range(dst, dst + data.len() as u64);
                Ok(Step::Done)
            }
            CopiedAll::Changing { done, pages, zeros } => {
                self.report.pages += pages;
                self.report.zero_pages += zeros;
                self.spaces[i].drop_range(dst, dst + done);
                Ok(Step::Changing)
            }
            CopiedAll::Gone => {
                self.ended(i)?;
                Ok(Step::Done)
            }
        }
    }
}
