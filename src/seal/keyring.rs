//! Where keys come from: age identities and passphrases given to this
//! process, recipients to wrap new keys for, and the keys already unwrapped.
//!
//! Reading works like an agent: the command line adds its identities
//! (`--identity`) or passphrase (`--passphrase-file`) once, and every archive
//! the process opens unlocks through them, wherever in the library it is
//! opened (a restore's archive, its parents, a dump's parent). A chain key,
//! once unwrapped, is kept by its id, so the parents of a chain (which share
//! it) cost no second unwrap, which for a passphrase is a second of scrypt
//! each. Secrets come from files, never from the command line.

use super::ChainKey;
use crate::error::{Error, IoContext, Result};
use crate::format::KeyRecord;
use age::secrecy::{ExposeSecret, SecretString};
use std::collections::HashMap;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::sync::{Arc, Mutex};

type Identities = Vec<Box<dyn age::Identity + Send + Sync>>;

#[derive(Default)]
struct Ring {
    identities: Identities,
    passphrase: Option<SecretString>,
    unlocked: HashMap<[u8; 16], Arc<ChainKey>>,
}

static RING: Mutex<Option<Ring>> = Mutex::new(None);

fn with_ring<T>(f: impl FnOnce(&mut Ring) -> T) -> T {
    let mut g = RING.lock().unwrap_or_else(|p| p.into_inner());
    f(g.get_or_insert_with(Ring::default))
}

/// The most a key, passphrase or recipients file may hold (thousands of
/// keys): more is another file given by mistake. `/dev/zero` was read until
/// memory ran out.
const KEY_FILE_MOST: u64 = 1 << 20;

/// Reads a key, passphrase or recipients file (`what` it is to be): it must
/// exist, be readable, be text and hold at most [`KEY_FILE_MOST`] bytes (a
/// file given where another was meant is a usage error naming it).
fn read_key_text(path: &Path, what: &str) -> Result<String> {
    crate::io::named_file(path)?;
    let mut bytes = Vec::new();
    std::fs::File::open(path).and_then(|f| f.take(KEY_FILE_MOST + 1).read_to_end(&mut bytes)).at(path)?;
    if bytes.len() as u64 > KEY_FILE_MOST {
        return Err(Error::Usage(format!("{}: not {what} (it holds more than 1 MiB)", path.display())));
    }
    String::from_utf8(bytes).map_err(|_| Error::Usage(format!("{}: not {what} (it is not text)", path.display())))
}

/// Reads a secret file (an identity or a passphrase).
fn read_secret(path: &Path) -> Result<String> {
    read_key_text(path, "a key or passphrase file")
}

/// Parses an age identity file (`AGE-SECRET-KEY-1…` lines, `#` comments).
fn parse_identities(path: &Path, text: &str) -> Result<Identities> {
    let bad = |why: String| Error::Usage(format!("{}: not an age identity file: {why}", path.display()));
    let file = age::IdentityFile::from_buffer(text.as_bytes()).map_err(|e| bad(e.to_string()))?;
    let ids = file.into_identities().map_err(|e| bad(e.to_string()))?;
    if ids.is_empty() {
        return Err(bad("it holds no identity".into()));
    }
    Ok(ids)
}

/// Adds the identities of an age identity file for opening archives.
pub fn add_identity_file(path: &Path) -> Result<()> {
    let ids = parse_identities(path, &read_secret(path)?)?;
    with_ring(|r| r.identities.extend(ids));
    Ok(())
}

/// A passphrase from a file: its first line, without the line end.
pub fn read_passphrase(path: &Path) -> Result<SecretString> {
    let text = read_secret(path)?;
    let line = text.lines().next().unwrap_or("");
    if line.is_empty() {
        return Err(Error::Usage(format!("{}: the passphrase file is empty", path.display())));
    }
    Ok(SecretString::from(line.to_string()))
}

/// Adds a passphrase (from its file) for opening archives.
pub fn add_passphrase_file(path: &Path) -> Result<()> {
    let p = read_passphrase(path)?;
    with_ring(|r| r.passphrase = Some(p));
    Ok(())
}

/// Keeps a chain key this process made or unwrapped, so archives of its
/// chain open without unwrapping it again.
pub fn remember(key: &ChainKey) {
    with_ring(|r| {
        r.unlocked.entry(key.id()).or_insert_with(|| Arc::new(key.clone()));
    });
}

/// Whether this process holds the chain key `key_id` names (made or
/// unwrapped here): an archive whose K record names one it does not hold
/// needs an identity or passphrase to open.
pub fn holds(key_id: &[u8; 16]) -> bool {
    with_ring(|r| r.unlocked.contains_key(key_id))
}

/// The chain key of an archive's K record: known already, or unwrapped with
/// the identities or passphrase given. Fails as [`Error::KeyNeeded`] when
/// none of its kind was given, as [`Error::Locked`] when none given opens
/// it, as corrupt when what it opens is not the key the record names.
pub fn unlock(rec: &KeyRecord, offset: u64) -> Result<Arc<ChainKey>> {
    if let Some(k) = with_ring(|r| r.unlocked.get(&rec.key_id).cloned()) {
        return Ok(k);
    }
    let dec = age::Decryptor::new_buffered(&rec.wrapped[..])
        .map_err(|e| Error::corrupt(offset, format!("the wrapped key is not an age file: {e}")))?;
    let key = if dec.is_scrypt() {
        let Some(pass) = with_ring(|r| r.passphrase.clone()) else {
            return Err(Error::KeyNeeded(
                "the archive is encrypted with a passphrase: give it with --passphrase-file FILE".into(),
            ));
        };
        let id = age::scrypt::Identity::new(pass);
        open_wrapped(dec, std::iter::once(&id as &dyn age::Identity))?
    } else {
        // The ring's lock is held while unwrapping: X25519 takes microseconds.
        let mut g = RING.lock().unwrap_or_else(|p| p.into_inner());
        let ring = g.get_or_insert_with(Ring::default);
        if ring.identities.is_empty() {
            return Err(Error::KeyNeeded(
                "the archive is encrypted: give the identity that opens it with --identity FILE".into(),
            ));
        }
        open_wrapped(dec, ring.identities.iter().map(|i| i.as_ref() as &dyn age::Identity))?
    };
    if key.id() != rec.key_id {
        return Err(Error::corrupt(offset, "the key record's key is not the key it names"));
    }
    remember(&key);
    Ok(Arc::new(key))
}

fn open_wrapped<'a>(dec: age::Decryptor<&[u8]>, ids: impl Iterator<Item = &'a dyn age::Identity>) -> Result<ChainKey> {
    let mut r = dec.decrypt(ids).map_err(|e| match e {
        age::DecryptError::NoMatchingKeys | age::DecryptError::DecryptionFailed => {
            Error::Locked("none of the keys given opens this encrypted archive".into())
        }
        age::DecryptError::ExcessiveWork { .. } => Error::Locked(format!("{e}")),
        e => Error::Locked(format!("the archive's key does not unwrap: {e}")),
    })?;
    let mut k = [0u8; 32];
    let mut rest = Vec::new();
    let whole = r.read_exact(&mut k).and_then(|()| r.read_to_end(&mut rest));
    if whole.is_err() || !rest.is_empty() {
        return Err(Error::corrupt(0, "the wrapped key is not a 32-byte key"));
    }
    Ok(ChainKey::from_bytes(k))
}

/// Whom a new archive's key is wrapped for: age recipients, or a passphrase
/// (age does not mix the two).
#[derive(Clone)]
pub struct Recipients {
    x25519: Vec<age::x25519::Recipient>,
    passphrase: Option<SecretString>,
}

impl std::fmt::Debug for Recipients {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Recipients({} keys, passphrase: {})", self.x25519.len(), self.passphrase.is_some())
    }
}

/// One public key (`age1…`).
pub fn parse_recipient(s: &str) -> Result<age::x25519::Recipient> {
    age::x25519::Recipient::from_str(s.trim())
        .map_err(|e| Error::Usage(format!("{:?} is not an age public key (age1...): {e}", s.trim())))
}

impl Recipients {
    /// From `--recipient` keys, `--recipients-file` files (one key a line,
    /// `#` comments) and `--passphrase-file`; `None` when none is given (the
    /// archive is not encrypted).
    pub fn from_args(keys: &[String], files: &[std::path::PathBuf], passphrase: Option<&Path>) -> Result<Option<Self>> {
        let mut x25519 = keys.iter().map(|k| parse_recipient(k)).collect::<Result<Vec<_>>>()?;
        for f in files {
            let text = read_key_text(f, "a recipients file")?;
            let mut n = 0;
            for line in text.lines().map(str::trim).filter(|l| !l.is_empty() && !l.starts_with('#')) {
                x25519.push(parse_recipient(line).map_err(|e| Error::Usage(format!("{}: {e}", f.display())))?);
                n += 1;
            }
            if n == 0 {
                return Err(Error::Usage(format!("{}: holds no recipient", f.display())));
            }
        }
        let passphrase = passphrase.map(read_passphrase).transpose()?;
        if passphrase.is_some() && !x25519.is_empty() {
            return Err(Error::Usage(
                "an archive is encrypted either to recipients or with a passphrase, not both".into(),
            ));
        }
        Ok((passphrase.is_some() || !x25519.is_empty()).then_some(Recipients { x25519, passphrase }))
    }

    /// Wraps `key` for these recipients: the K record's age file.
    pub fn wrap(&self, key: &ChainKey) -> Result<Vec<u8>> {
        let enc = match &self.passphrase {
            Some(p) => age::Encryptor::with_user_passphrase(p.clone()),
            None => age::Encryptor::with_recipients(self.x25519.iter().map(|r| r as &dyn age::Recipient))
                .map_err(|e| Error::Usage(format!("cannot encrypt to these recipients: {e}")))?,
        };
        let mut out = Vec::new();
        let mut w = enc.wrap_output(&mut out).map_err(Error::Io)?;
        std::io::Write::write_all(&mut w, key.bytes()).map_err(Error::Io)?;
        w.finish().map_err(Error::Io)?;
        Ok(out)
    }
}

/// A new age identity: the identity file's text (to be kept secret) and its
/// public key.
pub fn generate() -> (SecretString, String) {
    let id = age::x25519::Identity::generate();
    let public = id.to_public().to_string();
    let text = format!("# criuz keygen\n# public key: {public}\n{}\n", id.to_string().expose_secret());
    (SecretString::from(text), public)
}

/// The public keys of the identities in an age identity file (a child
/// dumped with `--identity` only is encrypted for the key that opens it).
pub fn recipients_of_identity_file(path: &Path) -> Result<Vec<String>> {
    let text = read_secret(path)?;
    let mut out = Vec::new();
    for line in text.lines().map(str::trim).filter(|l| l.starts_with("AGE-SECRET-KEY-")) {
        let id = age::x25519::Identity::from_str(line)
            .map_err(|e| Error::Usage(format!("{}: not an age identity: {e}", path.display())))?;
        out.push(id.to_public().to_string());
    }
    Ok(out)
}

/// The keys a command was given: identity files and a passphrase file.
/// Loaded into the process's keyring, they open every encrypted archive it
/// reads; for a new archive they also say whom it is encrypted for.
#[derive(Clone, Debug, Default)]
pub struct Keys {
    /// age identity files (`--identity`).
    pub identities: Vec<PathBuf>,
    /// A file whose first line is a passphrase (`--passphrase-file`).
    pub passphrase_file: Option<PathBuf>,
}

impl Keys {
    /// Gives the keys to the keyring, through which every archive this
    /// process opens is unlocked.
    pub fn load(&self) -> Result<()> {
        for f in &self.identities {
            add_identity_file(f)?;
        }
        if let Some(f) = &self.passphrase_file {
            add_passphrase_file(f)?;
        }
        Ok(())
    }

    /// Loads the keys, and says whom a new archive is encrypted for:
    /// `recipients` keys and `recipients_files`, or the passphrase; with
    /// none of those, the public keys of the identities given (a child
    /// dumped with `--identity` only is encrypted for the key that opens
    /// its parent); `None` when the archive is not to be encrypted.
    pub fn for_new_archive(&self, recipients: &[String], recipients_files: &[PathBuf]) -> Result<Option<Recipients>> {
        self.load()?;
        let mut keys = recipients.to_vec();
        if keys.is_empty() && recipients_files.is_empty() && self.passphrase_file.is_none() {
            for f in &self.identities {
                keys.extend(recipients_of_identity_file(f)?);
            }
        }
        Recipients::from_args(&keys, recipients_files, self.passphrase_file.as_deref())
    }
}

/// Makes a new age identity at `path` (mode 0600, published whole; a
/// missing key directory is made, private, as ssh-keygen does) and gives
/// its public key.
pub fn write_identity(path: &Path, force: bool) -> Result<String> {
    use std::os::unix::fs::DirBuilderExt;
    if let Some(what) = irreplaceable(path) {
        return Err(Error::Usage(format!(
            "{}: holds {what}; criuz never replaces one with a new key, even with --force (remove it yourself, or \
             write the key elsewhere)",
            path.display()
        )));
    }
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty() && !d.exists()) {
        std::fs::DirBuilder::new().recursive(true).mode(0o700).create(dir).at(dir)?;
    }
    let file = crate::io::AtomicFile::create(path, force)?;
    let public = write_identity_to(&mut file.writer()?, path)?;
    file.commit()?;
    Ok(public)
}

/// What a file at `path` holds that a new key written there would lose
/// for good: an age identity (the archives sealed to it open only with
/// it; `age-keygen` never overwrites a file either) or a criuz archive.
fn irreplaceable(path: &Path) -> Option<&'static str> {
    let head = crate::io::regular_file_head(path, 1 << 20)?;
    if head.starts_with(&crate::format::MAGIC) {
        return Some("a criuz archive");
    }
    let text = String::from_utf8_lossy(&head);
    text.lines()
        .any(|l| l.trim().starts_with("AGE-SECRET-KEY-"))
        .then_some("an age identity, which opens the archives sealed to it")
}

/// Makes a new age identity on `out` (a file, or a stream for `keygen -o
/// -`, to go straight into a secret store) and gives its public key. `name`
/// names `out` in an error.
pub fn write_identity_to(out: &mut dyn std::io::Write, name: &Path) -> Result<String> {
    let (secret, public) = generate();
    out.write_all(secret.expose_secret().as_bytes()).and_then(|()| out.flush()).at(name)?;
    Ok(public)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_key_file_that_is_no_text_is_a_usage_error_naming_it() {
        let dir = tempfile::tempdir().unwrap();
        let archive = dir.path().join("a.czr");
        std::fs::write(&archive, [0xffu8, 0xfe, 0x00, 0x80]).unwrap();
        for e in [add_identity_file(&archive).unwrap_err(), read_passphrase(&archive).unwrap_err()] {
            assert!(matches!(e, Error::Usage(_)), "{e:?}");
            assert!(e.to_string().contains("a.czr: not a key or passphrase file"), "{e}");
        }
    }
}
