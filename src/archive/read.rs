//! Decoding a whole archive front to back (unpack, verify): records come
//! through `check::CheckedRecords`, blocks are decoded and their data checked
//! on the worker pool, and a [`SeqSink`] receives every file's bytes in order.
//! The sink must not publish anything before `read_sequential` returns Ok: the
//! proof that the stream is whole (E records, index) comes at its end.

use super::check::{Checked, CheckedRecords};
use super::records::StreamInput;
use super::Options;
use crate::codec::Decoder;
use crate::engine;
use crate::error::{Error, Result};
use crate::format::{FileKind, Index, MAX_BLOCK, MIN_BLOCK};
use std::io::Read;

/// Receives a decoded archive in order.
pub trait SeqSink {
    fn begin(&mut self, file_id: u32, name: &str, kind: FileKind) -> Result<()>;
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
    let mut records = CheckedRecords::new(StreamInput(inp), true)?;
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
            Decoded::Other(Checked::FileBegin { file_id, name, kind }) => sink.begin(file_id, &name, kind)?,
            Decoded::Block { file_id, data } => sink.data(file_id, &data?)?,
            Decoded::Other(Checked::FileEnd(end)) => sink.end(end.file_id, end.raw_size)?,
            Decoded::Other(Checked::Index(index)) => return Ok(Some(index)),
            Decoded::Other(Checked::Block { .. }) => unreachable!("blocks are decoded"),
        }
    }
    Ok(None)
}
