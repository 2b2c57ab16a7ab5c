//! Page ids of an archive chain: what a new child dedups against
//! ([`dedup_index`], the write side's view of its parents), and the check
//! that an archive's P records name the pages its blocks store
//! ([`check_page_ids`], run by `verify`).

use super::block::BlockSource;
use super::check::{Checked, Payloads};
use super::dedup::{DedupIndex, PageAt};
use super::open::{ancestor_at, open, same_entry, OpenOptions, ParentSearch};
use super::stored::Archive;
use crate::error::{Error, Result, ResultContext};
use crate::format::{
    BlockCodec, BlockHeader, ChainEntry, DecodedDedup, DedupPayload, FileKind, PageId, FLAG_IDS, PAGE_SIZE,
};
use crate::io::Location;
use std::collections::HashMap;
use std::path::{Component, Path, PathBuf};

/// What a child written to `child` dedups against: every
/// page stored in `parent` or in the archives it refers to, at the archive
/// that stores it. Those archives are found as a restore would find them
/// (their hints, or beside the parent).
pub fn dedup_index(parent_path: &Path, child: &Location) -> Result<DedupIndex> {
    let at = Location::parse(parent_path)?;
    let parent_dir = at.base_dir().unwrap_or_else(|| PathBuf::from("."));
    let search = ParentSearch { files: Vec::new(), dirs: vec![parent_dir.clone()] };
    // A parent is a file or an object, never spooled from a pipe.
    let parent = open(&at, &OpenOptions { search: search.clone(), spool_cap: 0, ..OpenOptions::default() })?;
    // Written over the parent or an archive further up its chain, the
    // child would leave itself (and the parent) without it.
    if let Some(out) = child.path() {
        if same_entry(out, parent_path) {
            return Err(Error::Usage(format!("{}: the parent cannot be replaced by its own child", out.display())));
        }
        if let Some(found) = ancestor_at(&parent, &at, &search, out)? {
            return Err(Error::Usage(format!(
                "{}: {} is an ancestor of {} that the new archive's chain needs; replacing it would leave both \
                 without it (write the new archive elsewhere)",
                out.display(),
                found.display(),
                parent_path.display()
            )));
        }
    }
    let child_dir = child.base_dir().unwrap_or_else(|| PathBuf::from("."));
    // The child's chain: the parent, then every archive the parent refers to
    // (a parent's source k is the child's source k + 1).
    let mut chain =
        vec![ChainEntry { archive_id: parent.header().archive_id, hint: relative(parent_path, &child_dir) }];
    for e in parent.chain() {
        chain.push(ChainEntry { archive_id: e.archive_id, hint: relative(&parent_dir.join(&e.hint), &child_dir) });
    }
    let mut pages = HashMap::new();
    let archives = std::iter::once(&parent).chain(parent.parents());
    for (k, archive) in archives.enumerate() {
        let source = k as u16 + 1;
        let found = if archive.header().flags & FLAG_IDS != 0 {
            stored_ids(archive, source)
        } else {
            computed_ids(archive, source)
        };
        // The nearest archive wins a page stored twice (a root without ids
        // and a child that could not know it had it).
        for (id, loc) in found.context(|| archive.label().to_string())? {
            pages.entry(id).or_insert(loc);
        }
    }
    Ok(DedupIndex::keyed(chain, pages, parent.key().map(|k| k.chain().clone())))
}

/// Reads the page ids of an archive with ids: each stored page the P records
/// list, at its place in its block.
fn stored_ids(archive: &Archive, source: u16) -> Result<Vec<(PageId, PageAt)>> {
    // Read by position: the payloads of ordinary blocks (most of the
    // archive) are skipped, not read.
    let mut records = archive.records(Payloads::Dedup)?;
    let mut out = Vec::new();
    let mut block_no: Vec<u32> = Vec::new();
    let mut last: Option<(BlockHeader, Option<Vec<u8>>)> = None;
    while let Some((offset, rec)) = records.next_record()? {
        match rec {
            Checked::FileBegin { .. } => block_no.push(0),
            Checked::Block { header, payload, .. } => {
                block_no[header.file_id as usize] += 1;
                last = Some((header, payload));
            }
            Checked::Ids { file_id, ids, .. } => {
                let (header, payload) = last.take().expect("ids follow their block");
                if header.raw_len as usize % PAGE_SIZE != 0 {
                    continue; // a short last page is never shared
                }
                let block = block_no[file_id as usize] - 1;
                let stored = header.pages() - header.zero_pages();
                let literal: Vec<u32> = if header.codec == BlockCodec::Dedup {
                    let payload = payload.expect("dedup payloads are read");
                    let dp = DedupPayload::decode(&payload, stored, offset)?.head;
                    let slots = dp.literal_slots().enumerate();
                    slots.filter_map(|(i, k)| k.map(|_| i as u32)).collect()
                } else {
                    (0..stored as u32).collect()
                };
                let ids = ids.expect("ids are read");
                // CheckedRecords proved the P record lists exactly these pages.
                debug_assert_eq!(ids.len(), literal.len());
                for (id, page) in ids.into_iter().zip(literal) {
                    out.push((id, PageAt { source, file_id, block, page }));
                }
            }
            Checked::Chain(_) | Checked::FileEnd(_) | Checked::Index(_) => {}
        }
    }
    Ok(out)
}

/// An archive without page ids (a full archive written without `--ids`):
/// decodes its page images and hashes every stored page.
fn computed_ids(archive: &Archive, source: u16) -> Result<Vec<(PageId, PageAt)>> {
    let mut out = Vec::new();
    let mut dec = crate::codec::Decoder::new();
    let mut stored = Vec::new();
    let ids = archive.page_ids();
    for f in archive.index().files.iter().filter(|f| f.kind == FileKind::Pages) {
        let mut i = 0;
        while let Some(b) = archive.block(f.file_id, i)? {
            if b.header.raw_len as usize % PAGE_SIZE == 0 {
                b.decode_stored(&mut dec, &mut stored)?;
                for (p, page) in stored.chunks(PAGE_SIZE).enumerate() {
                    let loc = PageAt { source, file_id: f.file_id, block: i as u32, page: p as u32 };
                    out.push((ids.id(page), loc));
                }
            }
            i += 1;
        }
    }
    Ok(out)
}

/// Checks that every P record of `archive` names the pages its block stores
/// (`verify`): ids are never used to restore, but a child written against an
/// archive whose ids lie would refer to the wrong pages and fail its own
/// data checks, so that is found before anyone relies on it.
pub fn check_page_ids(archive: &Archive) -> Result<()> {
    if archive.header().flags & FLAG_IDS == 0 {
        return Ok(());
    }
    let label = archive.label().to_string();
    let mut records = archive.records(Payloads::All).context(|| label.clone())?;
    let mut dec = crate::codec::Decoder::new();
    let page_ids = archive.page_ids();
    let (mut literal, mut last) = (Vec::new(), None);
    while let Some((offset, rec)) = records.next_record().context(|| label.clone())? {
        match rec {
            Checked::Block { header, payload, .. } => last = Some((offset, header, payload)),
            Checked::Ids { ids, .. } => {
                let (at, header, payload) = last.take().expect("ids follow their block");
                let payload = payload.expect("payloads are read");
                let done = if header.codec == BlockCodec::Dedup {
                    let stored = header.pages() - header.zero_pages();
                    let DecodedDedup { head: dp, inner_payload: inner } =
                        DedupPayload::decode(&payload, stored, at).context(|| label.clone())?;
                    dec.decompress(dp.inner, inner, dp.literal_len as usize, &mut literal)
                } else {
                    dec.decompress(header.codec, &payload, header.stored_raw_len(), &mut literal)
                };
                done.map_err(|e| Error::corrupt(at, e)).context(|| label.clone())?;
                if !literal.chunks(PAGE_SIZE).map(|p| page_ids.id(p)).eq(ids.expect("ids are read")) {
                    return Err(Error::corrupt(offset, "page ids do not match the pages of the block before them"))
                        .context(|| label.clone());
                }
            }
            _ => {}
        }
    }
    Ok(())
}

/// `target` relative to directory `from` (both made absolute from the
/// current directory first); a hint, so any correct spelling will do.
fn relative(target: &Path, from: &Path) -> String {
    let abs = |p: &Path| {
        let p = if p.is_absolute() { p.to_path_buf() } else { std::env::current_dir().unwrap_or_default().join(p) };
        let mut out = PathBuf::new();
        for c in p.components() {
            match c {
                Component::ParentDir => {
                    out.pop();
                }
                Component::CurDir => {}
                c => out.push(c),
            }
        }
        out
    };
    let (t, f) = (abs(target), abs(from));
    let common = t.components().zip(f.components()).take_while(|(a, b)| a == b).count();
    let mut rel = PathBuf::new();
    for _ in f.components().skip(common) {
        rel.push("..");
    }
    for c in t.components().skip(common) {
        rel.push(c);
    }
    rel.to_string_lossy().into_owned()
}
