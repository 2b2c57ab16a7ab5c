//! The harnesses that measure criuz and attack it with real processes and
//! real CRIU: `criuz-bench` (time, size, memory against what users do
//! today) and `criuz-faults` (the fault campaign: kills, full disks, dead
//! peers on every path, and the invariants checked after each). Both share
//! the workloads, the S3 server, the container bundle and the process
//! helpers below.

// Read as built with `--document-private-items`, as the library's docs.
#![allow(rustdoc::private_intra_doc_links)]

pub mod aead;
pub mod codecs;
pub mod compare;
pub mod config;
pub mod containers;
pub mod error;
pub mod faults;
pub mod gpu;
pub mod incremental;
pub mod lazy;
pub mod load;
pub mod output;
pub mod plot;
pub mod proc;
pub mod report;
pub mod s3;
pub mod workload;
