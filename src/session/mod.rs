//! Sessions: what happens between CRIU and an archive. `capture` and `serve`
//! speak for one side of CRIU's streamer protocol; `checkpoint` runs CRIU
//! against them and owns the rules every command shares: when a dump is
//! complete, what a failure leaves behind, where CRIU's log goes. `lazy`
//! restores lazily, criuz serving the tree's page faults itself (`pager`,
//! from decoded `blocks`) under a `guard`. `receive` is criuz as the page
//! server of a dump, `follow` packs a dump directory while CRIU writes it,
//! `images_dir` writes one for a CRIU that reads a directory, and
//! `container` runs runc and podman with them. `restore` picks eager or
//! lazy for `criuz restore`; `standalone` is criuz on one side of a CRIU
//! the user runs (capture, serve, page server). `workdir` holds the private
//! directories CRIU runs in, and cleans up after a criuz that was killed.

pub mod blocks;
pub mod capture;
pub mod checkpoint;
pub mod container;
pub mod follow;
pub mod guard;
pub mod images_dir;
pub mod lazy;
pub mod pager;
pub mod receive;
pub mod restore;
pub mod serve;
pub mod standalone;
pub mod workdir;
