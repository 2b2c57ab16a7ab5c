//! Record heads read and parsed ahead of an opening walk, on other cores.
//!
//! A walk (`prove::walk`) takes each record's head in turn, one small read
//! and a parse apiece: 16,384 of them for a 4 GiB `mixed` archive, about
//! 30 ms on one core, which a lazy tree CRIU has restored waits for. The
//! index says where records start, so the walk cuts those starts into
//! segments and worker threads read and parse each segment's records (a
//! [`SeqReader`] from the segment's first start) while the walk checks
//! what came before. The walk takes a parsed record only where it stands
//! at that record's offset: a record's parse depends on its bytes, the
//! archive's header and its key alone, so it is what the walk would have
//! read there itself, whatever the index says. Anywhere else (a forged
//! index, a segment a worker could not parse) the walk reads on its own,
//! and its checks decide as they do without workers. At most
//! [`SEGMENTS_AHEAD`] segments are held at a time.

use super::fetch::StoreInput;
use super::records::{Input, ParsedHead, Record, SeqReader};
use crate::format::Header;
use crate::io::RecordStore;
use crate::seal::ArchiveKey;
use std::collections::VecDeque;
use std::io;
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock};

/// Record starts a segment begins apart.
const SEGMENT: usize = 256;
/// Segments parsed ahead of the walk at most: about 16,000 records, 2 MB.
const SEGMENTS_AHEAD: usize = 64;
/// Fewer starts than this are walked as they come: the workers would cost
/// more than they save.
const MIN_STARTS: usize = 4 * SEGMENT;
/// Most worker threads: the walk's own checks bound it beyond that (on 2
/// cores the walk itself took a sixth of the CPU a worker did, session 83).
const MAX_WORKERS: usize = 8;
/// Fewest cores that get workers. On 2 cores one worker beside the walk
/// made it slower (a 4 GiB `mixed` archive: 45 ms against 31 alone,
/// medians of nine, session 83), and there CRIU wants the other core.
const MIN_CORES: usize = 4;

/// The segments of one walk and what the workers parsed of them.
pub(crate) struct RecordsAhead<'a> {
    store: &'a dyn RecordStore,
    /// The store's length as the walk takes it.
    len: u64,
    header: Header,
    key: Option<Arc<ArchiveKey>>,
    /// First record start of each segment, ascending.
    starts: Vec<u64>,
    state: Mutex<State>,
    changed: Condvar,
}

#[derive(Default)]
struct State {
    /// Each segment's parsed records once read (`None`: not yet).
    parsed: Vec<Option<VecDeque<(u64, ParsedHead)>>>,
    /// The segment the walk stands in.
    walk_at: usize,
    /// The next segment a worker takes.
    next: usize,
    /// The walk is done, or a worker failed: nothing more is parsed or awaited.
    stop: bool,
    /// Records the walk took parsed.
    taken: usize,
}

impl<'a> RecordsAhead<'a> {
    /// Segments of the record starts the index gives (`starts`, ascending),
    /// over `store` taken to be `len` bytes long; `None` where too few.
    pub(crate) fn new(
        store: &'a dyn RecordStore,
        len: u64,
        header: Header,
        key: Option<Arc<ArchiveKey>>,
        starts: &[u64],
    ) -> Option<Self> {
        if starts.len() < MIN_STARTS || !starts.is_sorted() {
            return None;
        }
        let starts: Vec<u64> = starts.iter().step_by(SEGMENT).copied().collect();
        let state = State { parsed: (0..starts.len()).map(|_| None).collect(), ..State::default() };
        Some(RecordsAhead { store, len, header, key, starts, state: Mutex::new(state), changed: Condvar::new() })
    }

    /// Worker threads worth starting: one per core besides the walk's, none
    /// below [`MIN_CORES`].
    pub(crate) fn workers() -> usize {
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        if cores < MIN_CORES {
            0
        } else {
            (cores - 1).min(MAX_WORKERS)
        }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// One worker: parses the next segment not yet taken, within the
    /// window, until the walk is done or there is none left.
    pub(crate) fn work(&self) {
        loop {
            let k = {
                let mut st = self.lock();
                st.next = st.next.max(st.walk_at);
                while !st.stop && st.next < self.starts.len() && st.next >= st.walk_at + SEGMENTS_AHEAD {
                    st = self.changed.wait(st).unwrap_or_else(|e| e.into_inner());
                    st.next = st.next.max(st.walk_at);
                }
                if st.stop || st.next >= self.starts.len() {
                    return;
                }
                st.next += 1;
                st.next - 1
            };
            let mut segment = Segment { ahead: self, k, records: VecDeque::new() };
            self.parse(k, &mut segment.records);
        }
    }

    /// The records starting in segment `k`, up to the first that cannot be
    /// read (the walk meets it itself).
    fn parse(&self, k: usize, out: &mut VecDeque<(u64, ParsedHead)>) {
        let start = self.starts[k];
        let end = self.starts.get(k + 1).copied().unwrap_or(u64::MAX);
        let inp = StoreInput::heads_from(self.store, self.len, start);
        let mut reader = SeqReader::resume(inp, start, self.header.clone(), self.key.clone());
        while reader.offset() < end {
            let Ok(Some((at, record))) = reader.next_head() else { return };
            let head_len = reader.offset() - at;
            let (payload, last) = match record {
                Record::Ids { .. } => match reader.read_payload() {
                    Ok(p) => (Some(p), false),
                    Err(_) => return,
                },
                Record::Index { .. } => (None, true),
                _ => (None, false),
            };
            out.push_back((at, ParsedHead { record, head_len, payload }));
            if last {
                return;
            }
        }
    }

    /// The record parsed at `offset`, where the walk stands; `None` where
    /// no worker parsed one there.
    fn take(&self, offset: u64) -> Option<ParsedHead> {
        let mut st = self.lock();
        while st.walk_at + 1 < self.starts.len() && offset >= self.starts[st.walk_at + 1] {
            let k = st.walk_at;
            st.parsed[k] = None;
            st.walk_at += 1;
            self.changed.notify_all();
        }
        let k = st.walk_at;
        if offset < self.starts[k] {
            return None;
        }
        while st.parsed[k].is_none() {
            if st.stop {
                return None;
            }
            st = self.changed.wait(st).unwrap_or_else(|e| e.into_inner());
        }
        let queue = st.parsed[k].as_mut()?;
        while queue.front().is_some_and(|(at, _)| *at < offset) {
            queue.pop_front();
        }
        if queue.front().is_none_or(|(at, _)| *at != offset) {
            return None;
        }
        let (_, parsed) = queue.pop_front()?;
        st.taken += 1;
        Some(parsed)
    }

    /// Records the walk took parsed so far.
    pub(crate) fn taken(&self) -> usize {
        self.lock().taken
    }

    /// Nothing more is parsed or awaited (the walk is done).
    pub(crate) fn stop(&self) {
        self.lock().stop = true;
        self.changed.notify_all();
    }
}

/// A segment being parsed: handed to the walk when done, also when its
/// worker unwinds (which then stops the rest: the walk reads on alone).
struct Segment<'s, 'a> {
    ahead: &'s RecordsAhead<'a>,
    k: usize,
    records: VecDeque<(u64, ParsedHead)>,
}

impl Drop for Segment<'_, '_> {
    fn drop(&mut self) {
        let mut st = self.ahead.lock();
        if self.k >= st.walk_at {
            st.parsed[self.k] = Some(std::mem::take(&mut self.records));
        }
        if std::thread::panicking() {
            st.stop = true;
        }
        drop(st);
        self.ahead.changed.notify_all();
    }
}

/// A walk's input: its own reads, and the records parsed ahead wherever it
/// stands at one (once [`RecordsAhead`] is set).
pub(crate) struct AheadInput<'s, 'a> {
    inner: StoreInput<'a>,
    ahead: &'s OnceLock<RecordsAhead<'a>>,
}

impl<'s, 'a> AheadInput<'s, 'a> {
    pub(crate) fn new(inner: StoreInput<'a>, ahead: &'s OnceLock<RecordsAhead<'a>>) -> Self {
        AheadInput { inner, ahead }
    }
}

impl Input for AheadInput<'_, '_> {
    fn read_full(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        self.inner.read_full(buf)
    }
    fn skip(&mut self, n: u64) -> io::Result<u64> {
        self.inner.skip(n)
    }
    fn read_append(&mut self, buf: &mut Vec<u8>, n: usize) -> io::Result<usize> {
        self.inner.read_append(buf, n)
    }
    fn parsed_ahead(&mut self, offset: u64) -> Option<ParsedHead> {
        let (len, pos) = self.inner.len_and_pos();
        if pos != offset {
            return None;
        }
        let parsed = self.ahead.get()?.take(offset)?;
        // Read within the same length, so it fits; checked all the same.
        if parsed.head_len > len - pos || self.inner.skip(parsed.head_len).ok()? != parsed.head_len {
            return None;
        }
        Some(parsed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::format::FileEnd;

    fn end(file_id: u32) -> ParsedHead {
        ParsedHead {
            record: Record::FileEnd(FileEnd { file_id, raw_size: 0, file_check: 0 }),
            head_len: 25,
            payload: None,
        }
    }

    /// The walk takes a parsed record only at its own offset: never one
    /// that lies further on (the rest of a segment whose worker began off
    /// the records' chain), never one it has passed.
    #[test]
    fn a_parsed_record_is_taken_only_where_the_walk_stands() {
        let store: Vec<u8> = vec![0; 1 << 20];
        let starts: Vec<u64> = (0..MIN_STARTS as u64).map(|i| 100 + i * 100).collect();
        let ahead = RecordsAhead::new(&store, 1 << 20, Header::new(256 << 10), None, &starts).unwrap();
        assert!(RecordsAhead::new(&store, 1 << 20, Header::new(256 << 10), None, &starts[1..]).is_none(), "too few");
        {
            let mut st = ahead.lock();
            st.parsed[0] = Some([(100, end(1)), (300, end(3)), (500, end(5))].into_iter().collect());
            st.parsed[1] = Some(VecDeque::new());
        }
        assert!(ahead.take(50).is_none(), "before the first start");
        assert!(matches!(
            ahead.take(100),
            Some(ParsedHead { record: Record::FileEnd(FileEnd { file_id: 1, .. }), .. })
        ));
        assert!(ahead.take(200).is_none(), "the walk stands where no worker parsed");
        assert!(ahead.take(301).is_none(), "a byte past a parsed record");
        assert!(ahead.take(500).is_some());
        assert_eq!(ahead.taken(), 2);
        // Into the next segment, which its worker parsed nothing of; then
        // the walk is done and waits for nothing.
        assert!(ahead.take(starts[SEGMENT]).is_none());
        ahead.stop();
        assert!(ahead.take(starts[2 * SEGMENT] + 7).is_none());
    }
}
