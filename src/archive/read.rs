//! Decoding a whole archive (unpack, verify) into a [`SeqSink`], which
//! receives every file's bytes in order, blocks decoded and their data
//! checked on the worker pool. Two ways in: [`read_sequential`] streams an
//! archive front to back through `check::CheckedRecords` (a pipe needs no
//! spooling); the sink must then not publish anything before it returns Ok,
//! since the proof that the stream is whole (E records, index) comes at its
//! end. [`read_source`] reads through a block source: the only way for
//! version 2 archives, whose dedup blocks refer to other blocks and parents.

use super::block::BlockSource;
use super::check::{Checked, CheckedRecords, Payloads};
use super::records::StreamInput;
use super::Options;
use crate::codec::Decoder;
use crate::engine;
use crate::error::{Error, Result};
use crate::format::{EntryMeta, FileKind, Index, FLAG_IDS, FLAG_PARENT, MAX_BLOCK, MIN_BLOCK};
use std::io::Read;
use std::sync::Arc;

/// An entry as a [`SeqSink`] first sees it.
#[derive(Clone, Copy, Debug)]
pub struct EntryStart<'a> {
    pub file_id: u32,
    pub name: &'a str,
    pub kind: FileKind,
    /// Mode and mtime, in a tree archive.
    pub meta: Option<EntryMeta>,
    /// Its size when the reader knows it up front (from the index); a
    /// stream learns it only at the file's end.
    pub size: Option<u64>,
}

/// Receives a decoded archive in order.
pub trait SeqSink {
    fn begin(&mut self, entry: &EntryStart) -> Result<()>;
    fn data(&mut self, file_id: u32, data: &[u8]) -> Result<()>;
    fn end(&mut self, file_id: u32, raw_size: u64) -> Result<()>;
}

enum Job {
    Other(Checked),
    Block(Checked, u64),
}

enum Decoded {
    Other(Checked),
    Block { file_id: u32, data: Result<Vec<u8>> },
}

/// Decodes a whole archive (from a pipe or a file) on the worker pool,
/// checking everything. Returns the proven index.
pub fn read_sequential<R: Read + Send + 'static>(inp: R, opts: &Options, sink: &mut dyn SeqSink) -> Result<Index> {
    let mut records = CheckedRecords::new(StreamInput(inp), Payloads::All)?;
    if records.header().flags & (FLAG_PARENT | FLAG_IDS) != 0 {
        return Err(Error::unsupported(
            10,
            "a version 2 archive (incremental, or with page ids) is read through its block source",
        ));
    }
    let block_size = (records.header().block_size as usize).clamp(MIN_BLOCK, MAX_BLOCK);
    let window = engine::window_for(opts.memory_budget, block_size, opts.threads);
    let (sub, collector) = engine::start(opts.threads, window, Decoder::new, |dec: &mut Decoder, job: Job| match job {
        Job::Other(r) => Decoded::Other(r),
        Job::Block(Checked::Block { header, payload, .. }, offset) => {
            let mut out = Vec::new();
            let payload = payload.expect("payloads are read");
            let data = dec.decode(&header, &payload, &mut out).map(|_| out).map_err(|e| Error::corrupt(offset, e));
            Decoded::Block { file_id: header.file_id, data }
        }
        Job::Block(..) => unreachable!("only blocks are decoded"),
    });
    let producer = std::thread::spawn(move || -> Result<()> {
        while let Some((offset, rec)) = records.next_record()? {
            let job = match rec {
                b @ Checked::Block { .. } => Job::Block(b, offset),
                other => Job::Other(other),
            };
            sub.submit(job)?;
        }
        Ok(())
    });
    let consumed = consume(collector, sink);
    let produced = producer.join().map_err(|_| Error::Cancelled)?;
    match (produced, consumed) {
        (Err(e), Err(c)) if e.is_cancelled() => Err(c),
        (Ok(()), Err(e)) | (Err(e), _) => Err(e),
        (Ok(()), Ok(Some(index))) => Ok(index),
        (Ok(()), Ok(None)) => Err(Error::corrupt(0, "archive has no index")),
    }
}

fn consume(collector: engine::Collector<Decoded>, sink: &mut dyn SeqSink) -> Result<Option<Index>> {
    for r in collector {
        match r {
            Decoded::Other(Checked::FileBegin { file_id, name, kind, meta }) => {
                sink.begin(&EntryStart { file_id, name: &name, kind, meta, size: None })?
            }
            Decoded::Block { file_id, data } => sink.data(file_id, &data?)?,
            Decoded::Other(Checked::FileEnd(end)) => sink.end(end.file_id, end.raw_size)?,
            Decoded::Other(Checked::Index(index)) => return Ok(Some(index)),
            Decoded::Other(Checked::Block { .. }) => unreachable!("blocks are decoded"),
            Decoded::Other(Checked::Chain(_) | Checked::Ids { .. }) => {}
        }
    }
    Ok(None)
}

/// Decodes every file of a block source, in index order, each file's blocks
/// on the worker pool; returns the bytes decoded.
pub fn read_source(source: Arc<dyn BlockSource>, opts: &Options, sink: &mut dyn SeqSink) -> Result<u64> {
    let block_size = source.header().block_size as usize;
    let window = engine::window_for(opts.memory_budget, block_size, opts.threads);
    let mut total = 0;
    for entry in &source.index().files {
        let size = Some(entry.raw_size);
        sink.begin(&EntryStart {
            file_id: entry.file_id,
            name: &entry.name,
            kind: entry.kind,
            meta: entry.meta,
            size,
        })?;
        let n = entry.blocks.len();
        let src = source.clone();
        let file_id = entry.file_id;
        let (sub, results) =
            engine::start(opts.threads.min(n.max(1)), window, Decoder::new, move |dec: &mut Decoder, i: usize| {
                let b = src.block(file_id, i)?.ok_or_else(|| Error::corrupt(0, format!("block {i} is missing")))?;
                let mut out = Vec::new();
                b.decode(dec, &mut out).map(|_| out)
            });
        let feeder = std::thread::spawn(move || {
            for i in 0..n {
                if sub.submit(i).is_err() {
                    break;
                }
            }
        });
        let mut result = Ok(());
        for r in results {
            match r.and_then(|data| {
                total += data.len() as u64;
                sink.data(file_id, &data)
            }) {
                Ok(()) => {}
                Err(e) => {
                    result = Err(e);
                    break;
                }
            }
        }
        let _ = feeder.join();
        result?;
        sink.end(file_id, entry.raw_size)?;
    }
    Ok(total)
}
