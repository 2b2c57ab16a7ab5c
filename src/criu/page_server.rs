//! CRIU's page-server protocol, the receiving side: what `criu dump
//! --page-server` (and `runc checkpoint --page-server`) sends in place of
//! writing `pagemap-*.img`/`pages-*.img` (CRIU's `criu/page-xfer.c` is the
//! authority). One TCP connection per dump, no handshake; each command is a
//! fixed header, host byte order:
//!
//! | CRIU   | header | fields                                                      |
//! |--------|--------|-------------------------------------------------------------|
//! | >= 4.2 | 32 B   | u32 cmd, 4 pad, u64 nr_pages, u64 vaddr, u64 dst_id         |
//! | < 4.2  | 24 B   | u32 cmd, u32 nr_pages, u64 vaddr, u64 dst_id                |
//!
//! `cmd` is `flags << 16 | command`; `dst_id` is `id << 8 | type` (1: the
//! pagemap of process `id`, 2: of SysV/shared memory segment `id`). The
//! dump opens each pagemap (OPEN2, answered with one byte: has a parent),
//! adds runs of pages (ADD_F; with `PE_PRESENT` the run's pages follow the
//! header), and ends with CLOSE, answered with a 4-byte status that fails
//! the dump when non-zero. The first command (OPEN2 or PARENT) tells the
//! layout: its `vaddr` is 0 and its `dst_id` is not, so the u64 at offset 16
//! of the first 24 bytes is non-zero exactly for the old layout.
//!
//! Not carried: parents (OPEN2 and PARENT are answered "no parent", so CRIU
//! sends every page in full; incremental archives come from criuz's own
//! dedup), lazy-only entries (`dump --lazy-pages`), CRIU's `--tls` (its
//! first byte, a TLS record, is refused with a clear error).

use crate::error::{Error, Result};
use std::io::Read;

pub const PS_IOV_ADD: u32 = 1;
pub const PS_IOV_HOLE: u32 = 2;
pub const PS_IOV_OPEN: u32 = 3;
pub const PS_IOV_OPEN2: u32 = 4;
pub const PS_IOV_PARENT: u32 = 5;
pub const PS_IOV_ADD_F: u32 = 6;
pub const PS_IOV_GET: u32 = 7;
pub const PS_IOV_CLOSE: u32 = 0x1023;
pub const PS_IOV_FORCE_CLOSE: u32 = 0x1024;

const TLS_HANDSHAKE: u8 = 0x16;

/// Which header layout the dump uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Layout {
    /// CRIU >= 4.2: 32 bytes, 64-bit page count.
    Wide,
    /// CRIU < 4.2: 24 bytes, 32-bit page count.
    Narrow,
}

/// Whose pagemap a command is for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Target {
    Process(u64),
    Shmem(u64),
}

impl Target {
    /// The pagemap image CRIU would have written for it.
    pub fn pagemap_name(self) -> String {
        match self {
            Target::Process(pid) => format!("pagemap-{pid}.img"),
            Target::Shmem(id) => format!("pagemap-shmem-{id}.img"),
        }
    }
}

/// One command header.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Command {
    pub cmd: u32,
    /// `PE_*` flags (upper 16 bits of the command word).
    pub flags: u32,
    pub nr_pages: u64,
    pub vaddr: u64,
    pub dst_id: u64,
}

impl Command {
    pub fn target(&self) -> Result<Target> {
        match self.dst_id & 0xff {
            1 => Ok(Target::Process(self.dst_id >> 8)),
            2 => Ok(Target::Shmem(self.dst_id >> 8)),
            t => Err(proto(format!("unknown pagemap type {t} (CRIU older than 4.0?)"))),
        }
    }
}

/// A protocol error, named as the page server's.
pub(crate) fn proto(what: impl Into<String>) -> Error {
    Error::Protocol(format!("page server: {}", what.into()))
}

fn u32ne(b: &[u8]) -> u32 {
    u32::from_ne_bytes(b[..4].try_into().expect("4 bytes"))
}
fn u64ne(b: &[u8]) -> u64 {
    u64::from_ne_bytes(b[..8].try_into().expect("8 bytes"))
}

/// Reads command headers off a dump's connection.
pub struct CommandReader {
    layout: Option<Layout>,
}

impl Default for CommandReader {
    fn default() -> Self {
        Self::new()
    }
}

impl CommandReader {
    pub fn new() -> Self {
        CommandReader { layout: None }
    }

    pub fn layout(&self) -> Option<Layout> {
        self.layout
    }

    /// The next command, or `None` at a clean end of stream (between commands).
    pub fn next(&mut self, r: &mut impl Read) -> Result<Option<Command>> {
        let mut b = [0u8; 32];
        let first = match read_some(r, &mut b[..24])? {
            0 => return Ok(None),
            24 => true,
            n => return Err(proto(format!("connection closed inside a command header ({n} of 24 bytes)"))),
        } && self.layout.is_none();
        if first {
            if b[0] == TLS_HANDSHAKE && b[1] == 3 {
                return Err(proto("the dump speaks TLS (criu --tls); criuz's page server takes plain TCP"));
            }
            self.layout = Some(if u64ne(&b[16..]) != 0 { Layout::Narrow } else { Layout::Wide });
        }
        let wide = self.layout == Some(Layout::Wide);
        if wide && read_some(r, &mut b[24..32])? != 8 {
            return Err(proto("connection closed inside a command header"));
        }
        let word = u32ne(&b);
        let (nr_pages, vaddr, dst_id) = if wide {
            (u64ne(&b[8..]), u64ne(&b[16..]), u64ne(&b[24..]))
        } else {
            (u64::from(u32ne(&b[4..])), u64ne(&b[8..]), u64ne(&b[16..]))
        };
        Ok(Some(Command { cmd: word & 0xffff, flags: word >> 16, nr_pages, vaddr, dst_id }))
    }
}

/// read() until `buf` is full or EOF; returns the bytes read.
fn read_some(r: &mut impl Read, buf: &mut [u8]) -> Result<usize> {
    let mut got = 0;
    while got < buf.len() {
        match r.read(&mut buf[got..]) {
            Ok(0) => break,
            Ok(n) => got += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(proto(format!("reading from the dump: {e}"))),
        }
    }
    Ok(got)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn wide(cmd: u32, flags: u32, nr: u64, vaddr: u64, dst: u64) -> Vec<u8> {
        let mut v = (flags << 16 | cmd).to_ne_bytes().to_vec();
        v.extend_from_slice(&[0xAA; 4]); // padding is not zeroed by CRIU
        for x in [nr, vaddr, dst] {
            v.extend_from_slice(&x.to_ne_bytes());
        }
        v
    }

    fn narrow(cmd: u32, flags: u32, nr: u32, vaddr: u64, dst: u64) -> Vec<u8> {
        let mut v = (flags << 16 | cmd).to_ne_bytes().to_vec();
        v.extend_from_slice(&nr.to_ne_bytes());
        for x in [vaddr, dst] {
            v.extend_from_slice(&x.to_ne_bytes());
        }
        v
    }

    #[test]
    fn both_layouts_are_told_apart_by_the_first_command() {
        let mut s = wide(PS_IOV_OPEN2, 0, 0, 0, 1 << 8 | 1);
        s.extend(wide(PS_IOV_ADD_F, 4, 3, 0x7000, 1 << 8 | 1));
        let mut r = CommandReader::new();
        let mut cur = &s[..];
        let open = r.next(&mut cur).unwrap().unwrap();
        assert_eq!(r.layout(), Some(Layout::Wide));
        assert_eq!(open.target().unwrap(), Target::Process(1));
        let add = r.next(&mut cur).unwrap().unwrap();
        assert_eq!((add.cmd, add.flags, add.nr_pages, add.vaddr), (PS_IOV_ADD_F, 4, 3, 0x7000));
        assert!(r.next(&mut cur).unwrap().is_none());

        let mut s = narrow(PS_IOV_OPEN2, 0, 0, 0, 7 << 8 | 2);
        s.extend(narrow(PS_IOV_ADD_F, 6, 2, 0x9000, 7 << 8 | 2));
        let mut r = CommandReader::new();
        let mut cur = &s[..];
        assert_eq!(r.next(&mut cur).unwrap().unwrap().target().unwrap(), Target::Shmem(7));
        assert_eq!(r.layout(), Some(Layout::Narrow));
        let add = r.next(&mut cur).unwrap().unwrap();
        assert_eq!((add.flags, add.nr_pages, add.vaddr), (6, 2, 0x9000));
    }

    #[test]
    fn a_torn_header_and_tls_are_errors() {
        let s = wide(PS_IOV_OPEN2, 0, 0, 0, 1 << 8 | 1);
        assert!(CommandReader::new().next(&mut &s[..20]).is_err());
        assert!(CommandReader::new().next(&mut &s[..28]).is_err());
        let mut tls = vec![0x16, 3, 1];
        tls.resize(40, 0);
        assert!(CommandReader::new().next(&mut &tls[..]).is_err());
    }
}
