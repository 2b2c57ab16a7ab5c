//! Decoded pages of an archive for a lazy restore: the blocks of its pages
//! images through the checked block source, cached and decoded ahead.
//!
//! The pager (`session::pager`) answers faults anywhere while its fill
//! moves in address order, so a block would be decoded again at every
//! switch without a cache. Bounded in bytes, least recently used first out.
//! Where the pager's own thread fills a block at a time (one core), decoder
//! threads decode the blocks after the one the fill last asked for, each a
//! block no other is decoding, so that thread mostly copies; a fill in
//! steps on several cores decodes its blocks in its own threads
//! (`session::place`) and only faults come here.

use crate::archive::BlockSource;
use crate::codec::Decoder;
use crate::error::{Error, Result};
use crate::format::PAGE_SIZE;
use std::collections::HashMap;
use std::sync::Arc;

const CACHE_BYTES: usize = 24 << 20;
/// Blocks a decoder thread prepares beyond the last one asked for.
const DECODE_AHEAD: usize = 8;

type Key = (u32, usize);

#[derive(Default)]
struct Cache {
    blocks: HashMap<Key, Arc<Vec<u8>>>,
    order: std::collections::VecDeque<Key>,
    bytes: usize,
    /// The last block asked for, and whether the decoders should stop.
    cursor: Option<Key>,
    done: bool,
    /// Blocks a decoder thread is decoding now.
    decoding: std::collections::HashSet<Key>,
}

impl Cache {
    fn get(&mut self, k: Key) -> Option<Arc<Vec<u8>>> {
        let b = self.blocks.get(&k)?.clone();
        if let Some(i) = self.order.iter().position(|o| *o == k) {
            self.order.remove(i);
            self.order.push_back(k);
        }
        Some(b)
    }

    fn put(&mut self, k: Key, b: Arc<Vec<u8>>) {
        if self.blocks.contains_key(&k) {
            return;
        }
        self.bytes += b.len();
        self.blocks.insert(k, b);
        self.order.push_back(k);
        while self.bytes > CACHE_BYTES && self.order.len() > 1 {
            let old = self.order.pop_front().expect("non-empty");
            if let Some(b) = self.blocks.remove(&old) {
                self.bytes -= b.len();
            }
        }
    }
}

/// The pages of an archive's pages images through their checked blocks.
pub(crate) struct Blocks {
    pub(crate) source: Arc<dyn BlockSource>,
    starts: std::sync::Mutex<HashMap<u32, Arc<Vec<u64>>>>,
    cache: std::sync::Mutex<Cache>,
    wake: std::sync::Condvar,
}

impl Blocks {
    pub(crate) fn new(source: Arc<dyn BlockSource>) -> Blocks {
        Blocks { source, starts: Default::default(), cache: Default::default(), wake: Default::default() }
    }

    /// Where each block of image `file_id` starts (raw bytes).
    pub(crate) fn starts(&self, file_id: u32) -> Arc<Vec<u64>> {
        let mut m = self.starts.lock().expect("starts lock");
        m.entry(file_id)
            .or_insert_with(|| {
                let mut v = Vec::new();
                while let Some((_, raw_pos)) = self.source.block_header(file_id, v.len()) {
                    v.push(raw_pos);
                }
                Arc::new(v)
            })
            .clone()
    }

    fn decode(&self, dec: &mut Decoder, k: Key) -> Result<Arc<Vec<u8>>> {
        let b = self.source.block(k.0, k.1)?.ok_or_else(|| Error::corrupt(0, format!("block {} is missing", k.1)))?;
        let mut out = Vec::new();
        b.decode(dec, &mut out)?;
        Ok(Arc::new(out))
    }

    /// The decoded block of image `file_id` holding page `page`, and the
    /// image byte offset its data starts at. `fill` says the caller fills in order
    /// (the decoder thread follows it); a fault asks anywhere, and decoding
    /// after it would take CPU from the fill.
    pub(crate) fn block_at(
        &self,
        dec: &mut Decoder,
        file_id: u32,
        page: u64,
        fill: bool,
    ) -> Result<(Arc<Vec<u8>>, u64)> {
        let starts = self.starts(file_id);
        let at = page * PAGE_SIZE as u64;
        let i = starts.partition_point(|&s| s <= at).checked_sub(1);
        let i = i.ok_or_else(|| Error::corrupt(0, format!("page {page} lies before the first block")))?;
        let k = (file_id, i);
        let cached = {
            let mut c = self.cache.lock().expect("cache lock");
            if fill {
                c.cursor = Some(k);
            }
            // A decoder thread at work on it: wait rather than decode twice.
            while c.decoding.contains(&k) && !c.blocks.contains_key(&k) {
                c = self.wake.wait(c).expect("cache lock");
            }
            c.get(k)
        };
        if fill {
            self.wake.notify_one();
        }
        let data = match cached {
            Some(d) => d,
            None => {
                let d = self.decode(dec, k)?;
                self.cache.lock().expect("cache lock").put(k, d.clone());
                d
            }
        };
        if at - starts[i] + PAGE_SIZE as u64 > data.len() as u64 {
            return Err(Error::corrupt(0, format!("page {page} is not stored whole")));
        }
        Ok((data, starts[i]))
    }

    /// Decodes the blocks after the last one asked for until `finish`. A
    /// block that fails is left to the request that needs it, which reports
    /// the failure.
    pub(crate) fn decode_ahead(&self) {
        let mut dec = Decoder::new();
        let mut c = self.cache.lock().expect("cache lock");
        loop {
            if c.done {
                return;
            }
            let Some((file, i)) = c.cursor else {
                c = self.wake.wait(c).expect("cache lock");
                continue;
            };
            let n = self.starts(file).len();
            let next = (i + 1..(i + 1 + DECODE_AHEAD).min(n))
                .find(|&j| !c.blocks.contains_key(&(file, j)) && !c.decoding.contains(&(file, j)));
            let Some(j) = next else {
                c = self.wake.wait(c).expect("cache lock");
                continue;
            };
            c.decoding.insert((file, j));
            drop(c);
            let got = self.decode(&mut dec, (file, j));
            c = self.cache.lock().expect("cache lock");
            c.decoding.remove(&(file, j));
            let failed = got.is_err();
            if let Ok(d) = got {
                c.put((file, j), d);
            }
            // Whoever waits for this block (or for work) looks again.
            self.wake.notify_all();
            if failed {
                // Leave it to the request path; wait for the next request.
                c = self.wake.wait(c).expect("cache lock");
            }
        }
    }

    /// Forgets where the last fill was (materializing the images moved it).
    pub(crate) fn reset_cursor(&self) {
        self.cache.lock().expect("cache lock").cursor = None;
    }

    pub(crate) fn finish(&self) {
        self.cache.lock().expect("cache lock").done = true;
        self.wake.notify_all();
    }
}
