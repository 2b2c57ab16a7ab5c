//! The capabilities criuz holds (its effective set, from /proc), for the
//! machine check: root in a container or under a service manager may lack
//! some of those CRIU needs, and CRIU then fails late, deep in a dump.

/// A capability CRIU uses, with its bit number (linux/capability.h) and
/// what is lost without it.
pub struct Capability {
    pub name: &'static str,
    pub bit: u32,
    /// Whether no dump or restore runs without it.
    pub required: bool,
    /// What fails without it.
    pub without: &'static str,
}

/// What CRIU asks for as root, in the order it is reported
/// (`CAP_CHECKPOINT_RESTORE` is for CRIU without root, `--unprivileged`).
pub const USED_BY_CRIU: [Capability; 4] = [
    Capability { name: "CAP_SYS_ADMIN", bit: 21, required: true, without: "CRIU cannot dump or restore" },
    Capability { name: "CAP_SYS_PTRACE", bit: 19, required: true, without: "CRIU cannot seize a process" },
    Capability {
        name: "CAP_NET_ADMIN",
        bit: 12,
        required: false,
        without: "TCP connections cannot be dumped or restored (TCP repair)",
    },
    Capability {
        name: "CAP_SYS_RESOURCE",
        bit: 24,
        required: false,
        without: "a dump of another user's processes (PostgreSQL's) fails reading their resource limits",
    },
];

/// criuz's effective capability set, where /proc says.
pub fn effective() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    effective_in(&status)
}

/// The `CapEff:` line of a /proc status text, as a bit set.
fn effective_in(status: &str) -> Option<u64> {
    let hex = status.lines().find_map(|l| l.strip_prefix("CapEff:"))?;
    u64::from_str_radix(hex.trim(), 16).ok()
}

/// The capabilities of [`USED_BY_CRIU`] that `set` lacks.
pub fn missing(set: u64) -> impl Iterator<Item = &'static Capability> {
    USED_BY_CRIU.iter().filter(move |c| set & (1 << c.bit) == 0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_effective_set_is_read_from_its_line_and_what_it_lacks_is_named() {
        let status = "Name:\tcriuz\nCapInh:\t0000000000000000\nCapPrm:\t000001fffeffffff\n\
                      CapEff:\t000001fffeffffff\nCapBnd:\t000001ffffffffff\n";
        let set = effective_in(status).expect("a CapEff line");
        assert_eq!(set, 0x1fffeffffff);
        // Bit 24 (CAP_SYS_RESOURCE) is clear in that set, as on a
        // container's root that was given everything else.
        let lacking: Vec<&str> = missing(set).map(|c| c.name).collect();
        assert_eq!(lacking, ["CAP_SYS_RESOURCE"]);
        assert_eq!(missing(0).filter(|c| c.required).count(), 2);
        assert!(effective_in("Name:\tx\n").is_none());
    }
}
