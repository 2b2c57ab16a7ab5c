//! CRIU's own dump statistics: the `stats-dump` image CRIU writes into its
//! images directory (never streamed), which a dump adds to its archive and
//! reports.

use prost::Message;

/// CRIU's own dump statistics (stats-dump), in microseconds and pages.
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct CriuDumpStats {
    pub freezing_time_us: u32,
    pub frozen_time_us: u32,
    pub memdump_time_us: u32,
    pub memwrite_time_us: u32,
    pub pages_scanned: u64,
    pub pages_written: u64,
}

#[derive(Clone, PartialEq, Message)]
struct DumpStatsEntry {
    #[prost(uint32, required, tag = "1")]
    freezing_time: u32,
    #[prost(uint32, required, tag = "2")]
    frozen_time: u32,
    #[prost(uint32, required, tag = "3")]
    memdump_time: u32,
    #[prost(uint32, required, tag = "4")]
    memwrite_time: u32,
    #[prost(uint64, required, tag = "5")]
    pages_scanned: u64,
    #[prost(uint64, required, tag = "6")]
    pages_skipped_parent: u64,
    #[prost(uint64, required, tag = "7")]
    pages_written: u64,
}

#[derive(Clone, PartialEq, Message)]
struct StatsEntry {
    #[prost(message, optional, tag = "1")]
    dump: Option<DumpStatsEntry>,
}

/// Parses CRIU's stats-dump: two magics (service image), then a u32-length
/// prefixed stats_entry.
pub fn parse_stats(bytes: &[u8]) -> Option<CriuDumpStats> {
    let len = u32::from_ne_bytes(bytes.get(8..12)?.try_into().ok()?) as usize;
    let e = StatsEntry::decode(bytes.get(12..12 + len)?).ok()?.dump?;
    Some(CriuDumpStats {
        freezing_time_us: e.freezing_time,
        frozen_time_us: e.frozen_time,
        memdump_time_us: e.memdump_time,
        memwrite_time_us: e.memwrite_time,
        pages_scanned: e.pages_scanned,
        pages_written: e.pages_written,
    })
}
