//! An opened archive: what its opening proved (header, index, block
//! headers, parent chain), its records (through a [`RecordReader`]), its
//! parents once attached, and the [`BlockSource`] every reader reads it
//! through. It is made only by `archive::open`.
//!
//! What a [`CheckedBlock`] holds has been proven to be the block the index
//! says, at the position it says, of the file it says: its header is the
//! one the opening proved (`prove`), its payload matches its payload check
//! or its seal, and decoding it proves its data. An archive opened from
//! its index is proven by a walk behind; [`BlockSource::proven`] waits.
//!
//! A restore opens its archive with the read-ahead held (its first reads
//! are the images CRIU starts from), and its walk waits with it: the walk
//! asks the device for every record's first page at once, which from a
//! cold cache queued thousands of small reads ahead of those images (CRIU
//! started 35-40 ms later on a 124 MiB archive, docs/BENCHMARKS.md,
//! session 89). The walk starts when the reader lets the read-ahead run,
//! asks for it ([`BlockSource::start_proof`]) or first waits for the proof,
//! whichever comes first.

use super::block::{BlockSource, CheckedBlock};
use super::check::{check_payload, Checked, CheckedRecords, Payloads};
use super::fetch::{Fetched, RecordReader, StoreInput};
use super::prove::{self, ProvenBlock, Walked};
use super::resolve::{self, HolderCache, Holders};
use crate::error::{Error, Result, ResultContext};
use crate::format::{BlockCodec, BlockHeader, ChainEntry, Header, Index};
use crate::io::RecordStore;
use crate::seal::ArchiveKey;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock, Weak};

/// A seekable archive, proven when opened (or by a walk behind).
pub struct Archive {
    reader: RecordReader,
    label: Arc<str>,
    header: Header,
    index: Index,
    /// Proven block headers and first-byte positions, by file id.
    blocks: Vec<Vec<ProvenBlock>>,
    /// The parents named by the C record (empty without parents).
    chain: Vec<ChainEntry>,
    /// The opened parents, in C record order, or why they could not be
    /// opened.
    parents: OnceLock<Result<Vec<Arc<Archive>>>>,
    /// Set while the parents are being walked: a reader that meets a
    /// reference first waits for them instead of failing.
    parents_coming: AtomicBool,
    /// Recently decoded blocks that references point into.
    holders: HolderCache,
    /// Whether the full walk has proven the archive (unset while it runs).
    proof: OnceLock<Result<()>>,
    /// Holds a walk behind until the archive's pages are wanted: set once,
    /// `true` when the walk may start, `false` when the archive was dropped
    /// first (the first setting stands).
    walk_gate: Arc<OnceLock<bool>>,
}

impl Archive {
    /// Opens `store` by walking every record header through the checks.
    pub(crate) fn walked(store: Box<dyn RecordStore>, label: String) -> Result<Archive> {
        let walked = prove::walk(&*store)?;
        Ok(Archive::assemble(store, label, walked, true))
    }

    /// Opens `store` from its header, C record and index when it has a
    /// block table, and proves it by a walk on a thread behind
    /// ([`BlockSource::proven`] waits for it); walks it first otherwise.
    /// `walk_at_once`: the walk starts now, else once the reader resumes
    /// the read-ahead or waits for the proof (see the module's docs).
    pub(crate) fn indexed(store: Box<dyn RecordStore>, label: String, walk_at_once: bool) -> Result<Arc<Archive>> {
        let Some(read) = prove::from_table(&*store)? else {
            return Ok(Arc::new(Archive::walked(store, label)?));
        };
        let archive = Arc::new(Archive::assemble(store, label, read, false));
        if walk_at_once {
            let _ = archive.walk_gate.set(true);
        }
        // Held only weakly while the gate holds it: an archive dropped
        // before its pages were wanted ends the thread (`Drop`).
        let (gate, behind) = (archive.walk_gate.clone(), Arc::downgrade(&archive));
        std::thread::Builder::new()
            .name("criuz-proof".into())
            .spawn(move || {
                let Some(behind) = (*gate.wait()).then(|| Weak::upgrade(&behind)).flatten() else { return };
                // Readers wait for this result: it must be set however the walk ends.
                let walked = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| behind.walk_matches()));
                let r = walked.unwrap_or(Err(Error::Cancelled)).map_err(|e| e.context(behind.label.to_string()));
                let _ = behind.proof.set(r);
            })
            .map_err(|e| Error::thread_not_started("archive's proof", e))?;
        Ok(archive)
    }

    /// An archive from what its opening proved; `proven`: the whole of it
    /// (else the walk behind will say).
    fn assemble(store: Box<dyn RecordStore>, label: String, proved: Walked, proven: bool) -> Archive {
        let Walked { header, index, blocks, chain, key } = proved;
        Archive {
            reader: RecordReader::new(store, key),
            label: label.into(),
            header,
            index,
            blocks,
            chain,
            parents: OnceLock::new(),
            parents_coming: AtomicBool::new(false),
            holders: HolderCache::default(),
            proof: if proven { OnceLock::from(Ok(())) } else { OnceLock::new() },
            // No walk is left to hold once the archive is proven.
            walk_gate: Arc::new(if proven { OnceLock::from(true) } else { OnceLock::new() }),
        }
    }

    /// Whether a walk behind waits for the archive's pages to be wanted
    /// (tests).
    #[cfg(test)]
    pub(crate) fn walk_held(&self) -> bool {
        self.walk_gate.get().is_none()
    }

    /// How far the archive's store was asked to read ahead (tests).
    #[cfg(test)]
    pub(crate) fn read_ahead_wanted(&self) -> u64 {
        self.reader.store().read_ahead_wanted()
    }

    /// An encrypted archive's key (`None` when it is not encrypted).
    pub fn key(&self) -> Option<&Arc<ArchiveKey>> {
        self.reader.key()
    }

    /// How this archive's page ids are made (keyed in an encrypted chain).
    pub fn page_ids(&self) -> crate::seal::PageIds {
        self.key().map_or_else(crate::seal::PageIds::plain, |k| k.page_ids())
    }

    /// The full walk of an archive opened from its index: every record
    /// through the checks, and the index it ends with must be the one opened.
    fn walk_matches(&self) -> Result<()> {
        let walked = prove::walk_opened(self.reader.store(), &self.index)?;
        if walked.header != self.header || walked.chain != self.chain || walked.index != self.index {
            return Err(Error::corrupt(0, "the archive's records disagree with its index"));
        }
        Ok(())
    }

    /// The parents this archive refers to, as its C record names them.
    pub fn chain(&self) -> &[ChainEntry] {
        &self.chain
    }

    /// The opened parents (empty until attached).
    pub fn parents(&self) -> &[Arc<Archive>] {
        match self.parents.get() {
            Some(Ok(p)) => p,
            _ => &[],
        }
    }

    /// Says that the parents are being walked and will be attached (or
    /// reported failed): readers that need them wait until then.
    pub(crate) fn expect_parents(&self) {
        self.parents_coming.store(true, Ordering::Release);
    }

    /// Says that the parents cannot be attached, and why: waiting readers
    /// fail as cancelled, and [`Archive::parents_walked`] gives the reason.
    /// A no-op once attached.
    pub(crate) fn parents_failed(&self, why: Error) {
        let _ = self.parents.set(Err(why));
    }

    /// Gives the archive its opened parents, in C record order; each must be
    /// the archive the C record names.
    pub(crate) fn attach_parents(&self, parents: Vec<Arc<Archive>>) -> Result<()> {
        if parents.len() != self.chain.len()
            || parents.iter().zip(&self.chain).any(|(p, e)| p.header.archive_id != e.archive_id)
        {
            return Err(Error::Usage(format!("{}: parents given do not match its chain", self.label)));
        }
        self.parents.set(Ok(parents)).map_err(|_| Error::Usage(format!("{}: parents already attached", self.label)))
    }

    /// The parents, waiting for a walk under way to end.
    fn attached_parents(&self) -> Result<&[Arc<Archive>]> {
        let state = match self.parents.get() {
            // A reference with no chain points at an unknown parent.
            None if self.chain.is_empty() => return Ok(&[]),
            Some(state) => state,
            None if self.parents_coming.load(Ordering::Acquire) => self.parents.wait(),
            None => return Err(Error::Usage(format!("{}: its parents were not opened", self.label))),
        };
        state.as_deref().map_err(|_| Error::Cancelled)
    }

    /// The archive's records from the start, checked again as they are read.
    pub(crate) fn records(&self, payloads: Payloads) -> Result<CheckedRecords<StoreInput<'_>>> {
        CheckedRecords::new(StoreInput::new(self.reader.store()), payloads)
    }

    /// Record `i` of a file, its header checked against the proof.
    fn fetch_record(&self, file_id: u32, i: usize, pieced: bool) -> Result<Option<Fetched>> {
        let Some(entry) = self.index.files.get(file_id as usize) else { return Ok(None) };
        let Some(at) = entry.blocks.get(i) else { return Ok(None) };
        let proven = &self.blocks[file_id as usize][i].header;
        // A read that failed (a download cut off, a disk error) names the
        // archive; what the checks find names the block instead.
        let fetched = self.reader.fetch(at, proven, i, &entry.name, pieced);
        fetched.map(Some).map_err(|e| if matches!(e, Error::Io(_)) { e.context(self.label.to_string()) } else { e })
    }

    /// Record `i` of a file as fetched, as a block of its own, its payload
    /// checked against its payload check.
    fn checked(&self, file_id: u32, i: usize, f: Fetched) -> Result<CheckedBlock> {
        let Fetched { buf, range, header, offset } = f;
        // Only the payload's place at the record's end matters afterwards.
        let record = match Arc::try_unwrap(buf) {
            Ok(v) if range.end == v.len() => v,
            Ok(v) => v[range].to_vec(),
            Err(shared) => shared[range].to_vec(),
        };
        let raw_pos = self.blocks[file_id as usize][i].raw_pos;
        let block = CheckedBlock { header, record, offset, raw_pos, resolved: false, pieces: Vec::new() };
        check_payload(&block.header, block.payload(), offset, self.key().is_some())?;
        Ok(block)
    }
}

impl Drop for Archive {
    fn drop(&mut self) {
        let _ = self.walk_gate.set(false);
    }
}

impl BlockSource for Archive {
    fn label(&self) -> &str {
        &self.label
    }

    fn header(&self) -> &Header {
        &self.header
    }

    fn index(&self) -> &Index {
        &self.index
    }

    fn block_header(&self, file_id: u32, i: usize) -> Option<(&BlockHeader, u64)> {
        self.blocks.get(file_id as usize)?.get(i).map(|b| (&b.header, b.raw_pos))
    }

    fn proven(&self) -> Result<()> {
        let _ = self.walk_gate.set(true);
        self.proof.wait().as_ref().map_err(Error::duplicate).copied()
    }

    fn read_ahead(&self, on: bool) {
        if on {
            let _ = self.walk_gate.set(true);
        }
        self.reader.store().read_ahead(on);
    }

    fn start_proof(&self) {
        let _ = self.walk_gate.set(true);
    }

    fn parents_walked(&self) -> Result<()> {
        let state = match self.parents.get() {
            Some(state) => state,
            None if self.parents_coming.load(Ordering::Acquire) => self.parents.wait(),
            None => return Ok(()),
        };
        state.as_ref().map(drop).map_err(Error::duplicate)
    }

    fn prove_stored(&self) -> Result<()> {
        // Parents walked behind are proven once attached.
        self.parents_walked()?;
        for a in std::iter::once(self).chain(self.parents().iter().map(|p| &**p)) {
            let mut records = a.records(Payloads::All).context(|| a.label.to_string())?;
            // An AEAD tag proves every byte of an opened payload.
            let sealed = records.key().is_some();
            while let Some((offset, rec)) = records.next_record().context(|| a.label.to_string())? {
                if let Checked::Block { header, payload: Some(p), .. } = rec {
                    if header.codec == BlockCodec::Raw && !sealed {
                        crate::codec::check_parts(&header, &[&p])
                            .map_err(|e| Error::corrupt(offset, e))
                            .context(|| a.label.to_string())?;
                    }
                }
            }
        }
        Ok(())
    }

    fn block(&self, file_id: u32, i: usize) -> Result<Option<CheckedBlock>> {
        match self.fetch_record(file_id, i, false)? {
            Some(f) if f.header.codec == BlockCodec::Dedup => resolve::resolve(self, file_id, i as u32, f).map(Some),
            Some(f) => self.checked(file_id, i, f).map(Some),
            None => Ok(None),
        }
    }
}

impl Holders for Archive {
    fn name(&self) -> &Arc<str> {
        &self.label
    }

    fn fetch(&self, file_id: u32, block: usize, pieced: bool) -> Result<Option<Fetched>> {
        self.fetch_record(file_id, block, pieced)
    }

    fn literal_pages(&self, file_id: u32, block: u32) -> Option<u32> {
        self.blocks.get(file_id as usize)?.get(block as usize)?.literal_pages
    }

    fn raw_pos(&self, file_id: u32, block: u32) -> u64 {
        self.blocks[file_id as usize][block as usize].raw_pos
    }

    fn authenticated(&self) -> bool {
        self.key().is_some()
    }

    fn source(&self, k: u16, offset: u64) -> Result<&dyn Holders> {
        if k == 0 {
            return Ok(self);
        }
        let parent = self.attached_parents()?.get(k as usize - 1);
        Ok(&**parent.ok_or_else(|| Error::corrupt(offset, format!("reference to unknown parent {k}")))?)
    }

    fn holders(&self) -> &HolderCache {
        &self.holders
    }
}
