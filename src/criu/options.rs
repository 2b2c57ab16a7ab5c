//! CRIU's options as a CRIU run reads them, for the few criuz must know.
//!
//! CRIU reads its config files first (`/etc/criu/default.conf` and
//! `~/.criu/default.conf` unless `--config` or `--no-default-config` says
//! otherwise, then `$CRIU_CONFIG_FILE`, then a `--config` file), then its
//! command line; the last word on an option wins. Two things follow.
//!
//! - The options criuz sets itself (where images, log and pidfile go, how
//!   the tree is left) stand before the user's options after `--`, so one
//!   given there would override criuz's and break the run in ways CRIU's
//!   log does not explain (a dump whose log is lost, a restore whose pid
//!   criuz never sees). They are refused, each naming what to use instead.
//!   Config files come before criuz's options and cannot override them.
//! - A flag that changes what a failed dump leaves behind
//!   (`--tcp-established`) counts wherever it is set, a config file too.
//!
//! The command line is read the way CRIU's getopt reads it, with CRIU's
//! own table of options and their arguments (4.2), so that a value is
//! never taken for an option and an abbreviated long option is known by
//! its full name. Config files are read line by line as CRIU reads them:
//! an option name, then at most one value.

use crate::error::{Error, Result};
use std::path::{Path, PathBuf};

/// Whether an option takes a value.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Takes {
    Nothing,
    /// The rest of the word, or the next word.
    Value,
    /// Only the rest of the word (`-v4`, `--verbosity=4`).
    MaybeValue,
}

/// CRIU 4.2's long options (`criu/config.c`); those marked `flag` also
/// exist as `no-NAME`.
const LONG: &[(&str, Takes, bool)] = {
    use Takes::*;
    &[
        ("tree", Value, false),
        ("leave-stopped", Nothing, false),
        ("leave-running", Nothing, false),
        ("restore-detached", Nothing, true),
        ("restore-sibling", Nothing, true),
        ("daemon", Nothing, true),
        ("images-dir", Value, false),
        ("work-dir", Value, false),
        ("log-file", Value, false),
        ("join-ns", Value, false),
        ("root", Value, false),
        ("ext-unix-sk", MaybeValue, false),
        ("help", Nothing, false),
        ("tcp-established", Nothing, true),
        ("close", Value, false),
        ("log-pid", Nothing, true),
        ("version", Nothing, false),
        ("evasive-devices", Nothing, true),
        ("pidfile", Value, false),
        ("veth-pair", Value, false),
        ("action-script", Value, false),
        ("link-remap", Nothing, true),
        ("shell-job", Nothing, true),
        ("file-locks", Nothing, true),
        ("page-server", Nothing, true),
        ("address", Value, false),
        ("port", Value, false),
        ("prev-images-dir", Value, false),
        ("ms", Nothing, false),
        ("track-mem", Nothing, true),
        ("auto-dedup", Nothing, true),
        ("libdir", Value, false),
        ("cpu-cap", MaybeValue, false),
        ("force-irmap", Nothing, true),
        ("ext-mount-map", Value, false),
        ("exec-cmd", Nothing, false),
        ("manage-cgroups", MaybeValue, false),
        ("cgroup-root", Value, false),
        ("inherit-fd", Value, false),
        ("feature", Value, false),
        ("skip-mnt", Value, false),
        ("enable-fs", Value, false),
        ("enable-external-sharing", Nothing, false),
        ("enable-external-masters", Nothing, false),
        ("freeze-cgroup", Value, false),
        ("ghost-limit", Value, false),
        ("irmap-scan-path", Value, false),
        ("lsm-profile", Value, false),
        ("timeout", Value, false),
        ("external", Value, false),
        ("empty-ns", Value, false),
        ("lazy-pages", Nothing, false),
        ("extra", Nothing, true),
        ("experimental", Nothing, true),
        ("all", Nothing, false),
        ("cgroup-props", Value, false),
        ("cgroup-props-file", Value, false),
        ("cgroup-dump-controller", Value, false),
        ("skip-in-flight", Nothing, true),
        ("deprecated", Nothing, true),
        ("display-stats", Nothing, true),
        ("weak-sysctls", Nothing, true),
        ("status-fd", Value, false),
        ("tcp-close", Nothing, true),
        ("verbosity", MaybeValue, false),
        ("ps-socket", Value, false),
        ("stream", Nothing, true),
        ("config", Value, false),
        ("no-default-config", Nothing, false),
        ("tls-cacert", Value, false),
        ("tls-cacrl", Value, false),
        ("tls-cert", Value, false),
        ("tls-key", Value, false),
        ("tls", Nothing, true),
        ("tls-no-cn-verify", Nothing, false),
        ("cgroup-yard", Value, false),
        ("pre-dump-mode", Value, false),
        ("file-validation", Value, false),
        ("skip-file-rwx-check", Nothing, true),
        ("lsm-mount-context", Value, false),
        ("network-lock", Value, false),
        ("mntns-compat-mode", Nothing, true),
        ("unprivileged", Nothing, true),
        ("ghost-fiemap", Nothing, true),
        ("allow-uprobes", Nothing, true),
    ]
};

/// CRIU's short options and the long option each stands for.
const SHORT: &[(char, &str)] = &[
    ('d', "restore-detached"),
    ('S', "restore-sibling"),
    ('s', "leave-stopped"),
    ('R', "leave-running"),
    ('t', "tree"),
    ('h', "help"),
    ('D', "images-dir"),
    ('o', "log-file"),
    ('v', "verbosity"),
    ('x', "ext-unix-sk"),
    ('V', "version"),
    ('r', "root"),
    ('j', "shell-job"),
    ('J', "join-ns"),
    ('l', "file-locks"),
    ('W', "work-dir"),
    ('L', "libdir"),
    ('M', "ext-mount-map"),
];

/// One option as CRIU reads it: its full long name, whether it was given
/// as `no-NAME`, and the words it was given as (for messages).
#[derive(Clone, Debug, PartialEq, Eq)]
struct Given {
    name: &'static str,
    negated: bool,
    value: Option<String>,
    written: String,
    /// Where the value is: its word's index in the command line, and the
    /// byte it starts at in that word.
    value_at: Option<(usize, usize)>,
}

impl Given {
    /// `value`: its text and where it is (word, byte).
    fn new(name: &'static str, negated: bool, written: String, value: Option<(String, (usize, usize))>) -> Self {
        let (value, value_at) = value.map_or((None, None), |(v, at)| (Some(v), Some(at)));
        Given { name, negated, value, written, value_at }
    }

    /// How many words after word `i` (where the option is) its value took.
    fn skips(&self, i: usize) -> usize {
        usize::from(self.value_at.is_some_and(|(word, _)| word > i))
    }
}

/// The long option `word` (without `--` and `=value`) names: an exact
/// name, else the one name it abbreviates, as getopt resolves it.
fn long_option(word: &str) -> Option<(&'static str, Takes, bool)> {
    let names = LONG.iter().flat_map(|&(name, takes, flag)| {
        let negated = flag.then_some((name, takes, true));
        std::iter::once((name, takes, false)).chain(negated)
    });
    let spelled = |&(name, _, negated): &(&str, Takes, bool)| {
        if negated {
            format!("no-{name}")
        } else {
            name.to_string()
        }
    };
    if let Some(exact) = names.clone().find(|o| spelled(o) == word) {
        return Some(exact);
    }
    let mut prefixed = names.filter(|o| spelled(o).starts_with(word));
    let first = prefixed.next()?;
    // getopt takes an abbreviation of several spellings of one option (a
    // flag and its `no-` form differ) only where they are the same option.
    prefixed.all(|o| o == first).then_some(first)
}

/// The options in `args` (a command line without the program and action),
/// in order; words that are not options, or options CRIU does not know,
/// are passed over (CRIU reports those itself).
fn parse(args: &[String]) -> Vec<Given> {
    parse_words(args).0
}

/// [`parse`], and the words that are not options (CRIU's action first).
fn parse_words(args: &[String]) -> (Vec<Given>, Vec<&String>) {
    let mut out = Vec::new();
    let mut plain = Vec::new();
    let mut i = 0;
    // The word after `at`, as an option's value.
    let next = |at: usize| args.get(at + 1).map(|w| (w.clone(), (at + 1, 0)));
    while let Some(word) = args.get(i) {
        let mut skip = 0;
        if word == "--" {
            plain.extend(&args[i + 1..]);
            break;
        }
        if let Some(long) = word.strip_prefix("--") {
            let (name, attached) = match long.split_once('=') {
                Some((n, v)) => (n, Some((v.to_string(), (i, word.len() - v.len())))),
                None => (long, None),
            };
            if let Some((name, takes, negated)) = long_option(name) {
                let value = match (takes, attached) {
                    (Takes::Value, None) => next(i),
                    (_, attached) => attached,
                };
                let g = Given::new(name, negated, word.clone(), value);
                skip = g.skips(i);
                out.push(g);
            }
        } else if let Some(cluster) = word.strip_prefix('-').filter(|c| !c.is_empty()) {
            for (at, c) in cluster.char_indices() {
                let Some(&(_, name)) = SHORT.iter().find(|(s, _)| *s == c) else { break };
                let takes = LONG.iter().find(|(n, ..)| *n == name).map_or(Takes::Nothing, |o| o.1);
                let rest_at = at + c.len_utf8();
                let rest = &cluster[rest_at..];
                let written = format!("-{c}");
                if takes == Takes::Nothing {
                    out.push(Given::new(name, false, written, None));
                    continue;
                }
                let value = match (takes, rest.is_empty()) {
                    (Takes::Value, true) => next(i),
                    (Takes::MaybeValue, true) => None,
                    _ => Some((rest.to_string(), (i, 1 + rest_at))),
                };
                let g = Given::new(name, false, written, value);
                skip = g.skips(i);
                out.push(g);
                break;
            }
        } else {
            plain.push(word);
        }
        i += 1 + skip;
    }
    (out, plain)
}

/// CRIU options whose value is a path on this machine. CRIU reads them
/// after it has moved into its work directory (criuz's, private), where a
/// relative one names nothing: `-- --action-script ./hook.sh` failed the
/// dump "Pre dump script failed".
const PATH_VALUED: &[&str] = &[
    "action-script",
    "root",
    "libdir",
    "cgroup-props-file",
    "tls-cacert",
    "tls-cacrl",
    "tls-cert",
    "tls-key",
    "irmap-scan-path",
];

/// `extra` (the user's CRIU options) with each relative path of
/// [`PATH_VALUED`] made absolute from criuz's own directory, where the user
/// meant it.
pub fn anchored(extra: &[String]) -> Vec<String> {
    anchored_in(extra, &std::env::current_dir().unwrap_or_default())
}

/// [`anchored`], from `cwd`.
fn anchored_in(extra: &[String], cwd: &Path) -> Vec<String> {
    let mut out = extra.to_vec();
    for g in parse(extra).into_iter().filter(|g| PATH_VALUED.contains(&g.name)) {
        let (Some(value), Some((word, at))) = (g.value, g.value_at) else { continue };
        if value.is_empty() || Path::new(&value).is_absolute() {
            continue;
        }
        let absolute = cwd.join(&value).to_string_lossy().into_owned();
        out[word] = format!("{}{absolute}", &extra[word][..at]);
    }
    out
}

/// The action of a CRIU command line (`dump`, `restore`, ...: its first
/// word that is neither an option nor an option's value), and the line
/// without it. `args` is without the program.
pub fn action(args: &[String]) -> Option<(&str, Vec<String>)> {
    let (_, plain) = parse_words(args);
    let action = *plain.first()?;
    let at = args.iter().position(|a| std::ptr::eq(a, action))?;
    let rest = args[..at].iter().chain(&args[at + 1..]).cloned().collect();
    Some((action.as_str(), rest))
}

/// A config file's options as CRIU reads them, as command-line words:
/// each line is an option name (without `--`) and at most one value,
/// quoted or not; `#` starts a comment. Unreadable: none (as CRIU).
fn config_words(path: &Path) -> Vec<String> {
    let Ok(text) = std::fs::read_to_string(path) else { return Vec::new() };
    let mut words = Vec::new();
    for line in text.lines() {
        let line = line.trim_start();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let (name, rest) = line.split_once([' ', '\t']).unwrap_or((line, ""));
        words.push(format!("--{name}"));
        let rest = rest.trim_start();
        let value = if let Some(quoted) = rest.strip_prefix('"') {
            let mut end = None;
            let bytes = quoted.as_bytes();
            for (i, &b) in bytes.iter().enumerate() {
                if b == b'"' && (i == 0 || bytes[i - 1] != b'\\') {
                    end = Some(i);
                    break;
                }
            }
            end.map(|e| quoted[..e].replace("\\\"", "\""))
        } else {
            let word = rest.split([' ', '\t', '#']).next().unwrap_or("");
            (!word.is_empty()).then(|| word.to_string())
        };
        words.extend(value);
    }
    words
}

/// The config files CRIU reads, in its order, given the user's options.
fn config_files(extra: &[String]) -> Vec<PathBuf> {
    let given = parse(extra);
    let from_command_line = given.iter().rev().find(|g| g.name == "config").and_then(|g| g.value.clone());
    let no_default = from_command_line.is_some() || given.iter().any(|g| g.name == "no-default-config");
    let mut files = Vec::new();
    if !no_default {
        files.push(PathBuf::from("/etc/criu/default.conf"));
        if let Some(home) = std::env::var_os("HOME") {
            files.push(Path::new(&home).join(".criu/default.conf"));
        }
    }
    files.extend(std::env::var_os("CRIU_CONFIG_FILE").map(PathBuf::from));
    files.extend(from_command_line.map(PathBuf::from));
    files
}

/// What CRIU does, for the options criuz sets itself.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Action {
    Dump,
    Restore,
}

/// The options of a CRIU run whose command line ends with `extra` (the
/// user's options after `--`).
#[derive(Clone, Debug)]
pub struct CriuOptions {
    /// Config files' options, then the user's, in CRIU's order.
    given: Vec<Given>,
}

impl CriuOptions {
    /// Reads the config files CRIU would read for `extra`, and `extra`.
    pub fn read(extra: &[String]) -> Self {
        let config: Vec<String> = config_files(extra).iter().flat_map(|f| config_words(f)).collect();
        let mut given = parse(&config);
        given.extend(parse(extra));
        CriuOptions { given }
    }

    /// Whether boolean option `name` is on: the last word on it, from a
    /// config file or the command line.
    pub fn is_set(&self, name: &str) -> bool {
        self.given.iter().rev().find(|g| g.name == name).is_some_and(|g| !g.negated)
    }

    /// The value of option `name`, as the last word on it gives it.
    pub fn value(&self, name: &str) -> Option<&str> {
        self.given.iter().rev().find(|g| g.name == name)?.value.as_deref()
    }
}

/// Refuses, as a usage error, an option in `extra` that would override one
/// criuz sets on CRIU's command line for `action`, naming what to use.
pub fn check_extra(extra: &[String], action: Action) -> Result<()> {
    for g in parse(extra) {
        if let Some(instead) = owned(g.name, action) {
            return Err(Error::Usage(format!("CRIU option {} after --: {instead}", g.written)));
        }
    }
    Ok(())
}

/// What to use instead of CRIU option `name`, where criuz sets it for
/// `action`.
fn owned(name: &str, action: Action) -> Option<&'static str> {
    use Action::*;
    Some(match (name, action) {
        ("images-dir" | "work-dir" | "log-file" | "stream", _) => {
            "criuz sets it (the images go through criuz; CRIU's log of a failed run is kept, and named)"
        }
        ("lazy-pages", Dump) => "not with criuz dump (criuz restore --lazy restores any archive lazily)",
        ("lazy-pages", Restore) => "use criuz restore --lazy",
        ("page-server" | "address" | "port", Dump) => "use criuz page-server to receive a dump over the page-server protocol",
        ("page-server" | "address" | "port", Restore) => "criuz serves the pages itself",
        ("tree", Dump) => "use criuz dump -t PID",
        ("leave-running", Dump) => "use criuz dump --leave-running",
        ("leave-stopped", Dump) => {
            "not with criuz dump (the tree ends once its archive is durable, or runs on with criuz dump --leave-running)"
        }
        ("prev-images-dir", Dump) => "use criuz dump --parent ARCHIVE for an incremental archive",
        ("pidfile", Restore) => "use criuz restore --pidfile",
        ("restore-detached" | "daemon", Restore) => "use criuz restore -d",
        ("restore-sibling", Restore) => "criuz sets it (to wait for the restored tree)",
        ("leave-stopped", Restore) => "not with criuz restore (the restored tree runs; a tree dumped stopped stays stopped)",
        // CRIU would exec a command in its place after the restore, taking
        // its words from CRIU's command line after `--`, which has none.
        ("exec-cmd", _) => "criuz waits for the restored tree itself (without -d, criuz stays with it as its parent)",
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn words(s: &str) -> Vec<String> {
        s.split_whitespace().map(String::from).collect()
    }

    fn names(s: &str) -> Vec<(&'static str, bool, Option<String>)> {
        parse(&words(s)).into_iter().map(|g| (g.name, g.negated, g.value)).collect()
    }

    #[test]
    fn reads_the_command_line_as_getopt_does() {
        assert_eq!(
            names("--tcp-est -v4 -jD /x --action-script -D --log-file=l --no-link-remap stray -- --pidfile p"),
            vec![
                ("tcp-established", false, None),
                ("verbosity", false, Some("4".into())),
                ("shell-job", false, None),
                ("images-dir", false, Some("/x".into())),
                ("action-script", false, Some("-D".into())),
                ("log-file", false, Some("l".into())),
                ("link-remap", true, None),
            ]
        );
        // Ambiguous abbreviations and unknown options are CRIU's to report.
        assert_eq!(names("--no-re --t --bogus"), vec![]);
    }

    #[test]
    fn relative_paths_are_made_absolute_where_criu_would_read_them_elsewhere() {
        let cwd = Path::new("/home/u");
        let line = "--action-script ./a.sh --action=b.sh -r root -Lplugins -jr r2 -v4 --tls-key /abs/k \
                    --external file[x]:y --inherit-fd fd[1]:rel -D dir dump";
        let got = anchored_in(&words(line), cwd).join(" ");
        assert_eq!(
            got,
            "--action-script /home/u/./a.sh --action=/home/u/b.sh -r /home/u/root -L/home/u/plugins -jr /home/u/r2 \
             -v4 --tls-key /abs/k --external file[x]:y --inherit-fd fd[1]:rel -D dir dump"
        );
        // An option's value that looks like an option is its value still.
        assert_eq!(anchored_in(&words("--action-script -D"), cwd), words("--action-script /home/u/-D"));
        assert_eq!(anchored_in(&words("-- --root x"), cwd), words("-- --root x"));
    }

    #[test]
    fn the_action_is_the_first_word_that_is_no_option_nor_a_value() {
        let line = words("-v4 -o log dump -t 7 --leave-running");
        let (name, rest) = action(&line).unwrap();
        assert_eq!((name, rest), ("dump", words("-v4 -o log -t 7 --leave-running")));
        assert_eq!(action(&words("-D dump restore")).unwrap().0, "restore");
        assert!(action(&words("-t 7")).is_none());
    }

    #[test]
    fn options_criuz_sets_are_refused_with_what_to_use() {
        let refused = |s: &str, a| check_extra(&words(s), a).unwrap_err().to_string();
        assert!(refused("--tcp-established -R", Action::Dump).contains("criuz dump --leave-running"));
        assert!(refused("-d", Action::Restore).contains("criuz restore -d"));
        assert!(refused("--pid /p", Action::Restore).contains("--pidfile"));
        assert!(refused("-W/x", Action::Dump).contains("criuz sets it"));
        assert!(check_extra(&words("--tcp-established --ext-unix-sk -v4 --action-script -D"), Action::Dump).is_ok());
        assert!(check_extra(&words("--leave-running --shell-job"), Action::Restore).is_ok());
        assert!(check_extra(&words("--pidfile /p"), Action::Dump).is_ok());
        assert!(refused("--exec-cmd", Action::Restore).contains("criuz waits for the restored tree itself"));
    }

    #[test]
    fn a_config_file_counts_until_the_command_line_says_otherwise() {
        let dir = tempfile::tempdir().unwrap();
        let conf = dir.path().join("c.conf");
        std::fs::write(&conf, "# comment\n  tcp-established\nlsm-profile \"a b\" # note\nlink-remap\n").unwrap();
        let mut expected = words("--tcp-established --lsm-profile");
        expected.extend(["a b".to_string(), "--link-remap".to_string()]);
        assert_eq!(config_words(&conf), expected);
        let with =
            |s: &str| CriuOptions::read(&[words(s), vec!["--config".into(), conf.display().to_string()]].concat());
        assert!(with("").is_set("tcp-established"));
        assert!(with("").is_set("link-remap"));
        assert!(!with("--no-tcp-established").is_set("tcp-established"));
        assert!(!with("").is_set("leave-running"));
    }
}
