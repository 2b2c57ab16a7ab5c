//! CRIU's page-server protocol, the side that answers a lazy-pages daemon
//! (criu/page-xfer.c): the daemon sends fixed-size `page_server_iov`
//! requests, `PS_IOV_GET` for `nr_pages` pages of process `dst_id` (the
//! pid itself, not the pagemap id the dump side uses) at `vaddr`; each is answered, in order, with a `PS_IOV_ADD_F` header (the
//! same request, `nr_pages` possibly fewer but never 0) followed by the
//! pages. `PS_IOV_CLOSE` is answered with a 32-bit 0 and ends the session.
//!
//! CRIU 4.2 widened `nr_pages` from 32 to 64 bits, which moved the other
//! fields: 24-byte requests before, 32 bytes from 4.2 on ([`Wire`]).

use std::io::{self, Read, Write};

const PS_IOV_ADD_F: u32 = 6;
const PS_IOV_GET: u32 = 7;
const PS_IOV_CLOSE: u32 = 0x1023;
const PS_IOV_FORCE_CLOSE: u32 = 0x1024;
const PS_CMD_MASK: u32 = 0xffff;
const PE_PRESENT: u32 = 1 << 2;

/// The request layout a CRIU version speaks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Wire {
    /// Before 4.2: {u32 cmd, u32 nr_pages, u64 vaddr, u64 dst_id}.
    Narrow,
    /// 4.2 and later: {u32 cmd, 4 bytes padding, u64 nr_pages, u64 vaddr, u64 dst_id}.
    Wide,
}

impl Wire {
    /// The layout of CRIU `version` ("4.1.1", "4.2.1").
    pub fn for_version(version: &str) -> Wire {
        let mut parts = version.split('.').map(|p| p.parse::<u32>().unwrap_or(0));
        let (major, minor) = (parts.next().unwrap_or(0), parts.next().unwrap_or(0));
        if (major, minor) >= (4, 2) {
            Wire::Wide
        } else {
            Wire::Narrow
        }
    }

    fn len(self) -> usize {
        match self {
            Wire::Narrow => 24,
            Wire::Wide => 32,
        }
    }
}

/// What the daemon asked for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Request {
    /// `nr_pages` pages of process `pid` from `vaddr`.
    Get {
        pid: u32,
        vaddr: u64,
        nr_pages: u64,
    },
    Close,
}

#[derive(Debug, thiserror::Error)]
pub enum ProtocolError {
    #[error("page server: {0}")]
    Io(#[from] io::Error),
    #[error("page server: unexpected request (command {cmd:#x}, id {dst_id:#x})")]
    Unexpected { cmd: u32, dst_id: u64 },
}

fn encode(wire: Wire, cmd: u32, nr_pages: u64, vaddr: u64, dst_id: u64) -> Vec<u8> {
    let mut b = Vec::with_capacity(wire.len());
    b.extend_from_slice(&cmd.to_ne_bytes());
    match wire {
        Wire::Narrow => b.extend_from_slice(&(nr_pages as u32).to_ne_bytes()),
        Wire::Wide => {
            b.extend_from_slice(&[0; 4]);
            b.extend_from_slice(&nr_pages.to_ne_bytes());
        }
    }
    b.extend_from_slice(&vaddr.to_ne_bytes());
    b.extend_from_slice(&dst_id.to_ne_bytes());
    b
}

/// Reads the next request; `None` when the daemon closed the connection.
pub fn read_request(sock: &mut impl Read, wire: Wire) -> Result<Option<Request>, ProtocolError> {
    let mut b = [0u8; 32];
    let b = &mut b[..wire.len()];
    let mut got = 0;
    while got < b.len() {
        match sock.read(&mut b[got..]) {
            Ok(0) if got == 0 => return Ok(None),
            Ok(0) => return Err(io::Error::from(io::ErrorKind::UnexpectedEof).into()),
            Ok(n) => got += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e.into()),
        }
    }
    let u32_at = |at: usize| u32::from_ne_bytes(b[at..at + 4].try_into().expect("4 bytes"));
    let u64_at = |at: usize| u64::from_ne_bytes(b[at..at + 8].try_into().expect("8 bytes"));
    let cmd = u32_at(0);
    let (nr_pages, vaddr, dst_id) = match wire {
        Wire::Narrow => (u64::from(u32_at(4)), u64_at(8), u64_at(16)),
        Wire::Wide => (u64_at(8), u64_at(16), u64_at(24)),
    };
    match cmd & PS_CMD_MASK {
        PS_IOV_GET if nr_pages > 0 => {
            let pid = u32::try_from(dst_id).map_err(|_| ProtocolError::Unexpected { cmd, dst_id })?;
            Ok(Some(Request::Get { pid, vaddr, nr_pages }))
        }
        _ if cmd == PS_IOV_CLOSE || cmd == PS_IOV_FORCE_CLOSE => Ok(Some(Request::Close)),
        _ => Err(ProtocolError::Unexpected { cmd, dst_id }),
    }
}

/// Answers a `Get` for `pid` at `vaddr` with `pages` (whole pages, at least one).
pub fn send_pages(sock: &mut impl Write, wire: Wire, pid: u32, vaddr: u64, pages: &[u8]) -> io::Result<()> {
    debug_assert!(!pages.is_empty() && pages.len() % 4096 == 0);
    let dst_id = u64::from(pid);
    let cmd = PS_IOV_ADD_F | PE_PRESENT << 16;
    sock.write_all(&encode(wire, cmd, (pages.len() / 4096) as u64, vaddr, dst_id))?;
    sock.write_all(pages)
}

/// Answers `Close`: everything asked for was sent.
pub fn send_closed(sock: &mut impl Write) -> io::Result<()> {
    sock.write_all(&0u32.to_ne_bytes())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn both_layouts_round_trip_a_get() {
        for wire in [Wire::Narrow, Wire::Wide] {
            let req = encode(wire, PS_IOV_GET, 3, 0x7f00_0000_1000, 42);
            assert_eq!(req.len(), wire.len());
            let got = read_request(&mut &req[..], wire).unwrap();
            assert_eq!(got, Some(Request::Get { pid: 42, vaddr: 0x7f00_0000_1000, nr_pages: 3 }));
        }
        assert_eq!(Wire::for_version("4.1.1"), Wire::Narrow);
        assert_eq!(Wire::for_version("4.2.1"), Wire::Wide);
        assert_eq!(Wire::for_version("5.0"), Wire::Wide);
    }

    #[test]
    fn close_ends_and_anything_else_is_refused() {
        let close = encode(Wire::Wide, PS_IOV_CLOSE, 0, 0, 0);
        assert_eq!(read_request(&mut &close[..], Wire::Wide).unwrap(), Some(Request::Close));
        assert_eq!(read_request(&mut &[][..], Wire::Wide).unwrap(), None);
        // An id that is no pid, a zero count and an unknown command.
        for (cmd, nr, id) in [(PS_IOV_GET, 1, 1 << 40), (PS_IOV_GET, 0, 7), (1, 1, 7)] {
            let req = encode(Wire::Narrow, cmd, nr, 0, id);
            assert!(read_request(&mut &req[..], Wire::Narrow).is_err());
        }
        let short = &encode(Wire::Wide, PS_IOV_GET, 1, 0, 7)[..20];
        assert!(read_request(&mut &short[..], Wire::Wide).is_err());
    }
}
