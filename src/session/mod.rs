//! Sessions: what happens between CRIU and an archive. `capture` and `serve`
//! speak for one side of CRIU's streamer protocol; `checkpoint` runs CRIU
//! against them and owns the rules every command shares: when a dump is
//! complete, what a failure leaves behind, where CRIU's log goes. `lazy`
//! restores lazily, criuz serving the tree's page faults itself (`pager`,
//! from decoded `blocks`) under a `guard`.

pub mod blocks;
pub mod capture;
pub mod checkpoint;
pub mod guard;
pub mod lazy;
pub mod pager;
pub mod serve;
