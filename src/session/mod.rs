//! Sessions: what happens between CRIU and an archive. `capture` and `serve`
//! speak for one side of CRIU's streamer protocol; `checkpoint` runs CRIU's
//! dump and restore against them and owns the rules they follow: when a dump
//! is complete, what a failure leaves behind. `criu_run` is what every
//! command that runs CRIU shares: the restore command line and options, the
//! pidfile, CRIU failures and their log, the pids a restore needs free;
//! `memory_room` refuses a restore whose memory cannot fit.
//! `lazy` restores lazily, criuz serving the tree's page faults itself
//! (`pager`, from decoded `blocks`) under a guard (`proc::guard`), and
//! eagerly with the tree held stopped while `place` fills it on every core;
//! `placement` writes the images CRIU restores such a tree from, and
//! `working_set` keeps the pages a lazy tree faulted first for the next.
//! `receive` is criuz as the page server of a dump, `follow` packs a dump
//! directory while CRIU writes it, `images_dir` writes one for a CRIU that
//! reads a directory, and `container` and `podman` run runc and podman with
//! them.
//! `criu_hook` answers CRIU's action scripts where CRIU waits for criuz (a
//! dump only CRIU can roll back; a container's lazy tree before it runs).
//! `restore` picks placed, streamed or lazy for `criuz restore`;
//! `standalone` is criuz on one side of a CRIU the user runs (capture,
//! serve, page server). `check` tells whether this machine can dump and
//! restore, and which ways it can take. `workdir` holds the private directories CRIU runs
//! in, and cleans up after a criuz that was killed. The OS machinery (/proc
//! trees, the forked guard, cgroups, socket tricks) is in `proc`, which
//! knows nothing of sessions.

pub mod blocks;
pub mod capture;
pub mod check;
pub mod checkpoint;
pub mod container;
pub mod criu_hook;
pub mod criu_run;
pub mod follow;
pub mod images_dir;
pub mod lazy;
pub mod memory_room;
pub mod pager;
pub mod place;
pub mod placement;
pub mod podman;
pub mod receive;
pub mod restore;
pub mod serve;
pub mod shmem;
pub mod standalone;
pub mod workdir;
pub mod working_set;
