//! The CUDA driver's checkpoint calls, loaded from libcuda at run time
//! (`dlopen` through `libloading`): criuz has no build or install dependency
//! on CUDA, and a machine without the driver is a machine without CUDA
//! processes. These are the calls NVIDIA's `cuda-checkpoint` utility makes
//! (driver 570 or newer): lock a process (its CUDA calls then block, with a
//! timeout for work already submitted), checkpoint it (device memory copied
//! into its host memory, the GPU released), restore (host to device, on the
//! same GPUs or on others named by UUID pairs) and unlock.
//!
//! `CRIUZ_LIBCUDA` names another library (the tests' fake driver).

use std::ffi::{c_char, c_int, c_uint, c_void, CStr};
use std::fmt;

/// A CUDA process's checkpoint state (`CUprocessState`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ProcessState {
    Running,
    Locked,
    Checkpointed,
    Failed,
}

/// A failed driver call: its name and the driver's error name.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{call}: {name} ({code})")]
pub struct DriverError {
    pub call: &'static str,
    pub code: i32,
    pub name: String,
}

/// A GPU as the driver lists it.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Gpu {
    /// `GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx`, as nvidia-smi prints it.
    pub uuid: String,
    pub name: String,
}

type Uuid = [u8; 16];

#[repr(C)]
struct LockArgs {
    timeout_ms: c_uint,
    reserved0: c_uint,
    reserved1: [u64; 7],
}

#[repr(C)]
struct GpuPair {
    old: Uuid,
    new: Uuid,
}

/// `CUcheckpointRestoreArgs`: 64 bytes, the pairs and their count first,
/// the rest zero.
#[repr(C)]
struct RestoreArgs {
    pairs: *const GpuPair,
    count: c_uint,
    reserved: [u8; 52],
}

type Status = c_int;

/// The loaded driver.
pub struct Driver {
    // Kept loaded for as long as the function pointers below are used.
    _lib: libloading::Library,
    init: unsafe extern "C" fn(c_uint) -> Status,
    driver_version: unsafe extern "C" fn(*mut c_int) -> Status,
    device_count: unsafe extern "C" fn(*mut c_int) -> Status,
    device_get: unsafe extern "C" fn(*mut c_int, c_int) -> Status,
    device_uuid: unsafe extern "C" fn(*mut Uuid, c_int) -> Status,
    device_name: unsafe extern "C" fn(*mut c_char, c_int, c_int) -> Status,
    error_name: unsafe extern "C" fn(Status, *mut *const c_char) -> Status,
    get_state: unsafe extern "C" fn(c_int, *mut c_int) -> Status,
    lock: unsafe extern "C" fn(c_int, *mut LockArgs) -> Status,
    checkpoint: unsafe extern "C" fn(c_int, *mut c_void) -> Status,
    restore: unsafe extern "C" fn(c_int, *mut RestoreArgs) -> Status,
    unlock: unsafe extern "C" fn(c_int, *mut c_void) -> Status,
}

/// Why the driver could not be loaded.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    /// No such library: this machine has no CUDA driver.
    #[error("this machine has no CUDA driver ({1})")]
    Absent(String, libloading::Error),
    /// The library lacks a call criuz needs (a driver older than 570).
    #[error("{0}: lacks {1} (the CUDA checkpoint calls need driver 570 or newer)")]
    TooOld(String, &'static str),
}

/// The library to load: `CRIUZ_LIBCUDA`, else the driver's own soname.
pub fn library_name() -> String {
    std::env::var("CRIUZ_LIBCUDA").unwrap_or_else(|_| "libcuda.so.1".into())
}

impl Driver {
    pub fn load() -> Result<Driver, LoadError> {
        let name = library_name();
        // SAFETY: loading libcuda runs its initialisers, which is what every
        // CUDA program does; the symbols are then typed as cuda.h declares them.
        let lib = unsafe { libloading::Library::new(&name) }.map_err(|e| LoadError::Absent(name.clone(), e))?;
        macro_rules! sym {
            ($name:literal) => {
                // SAFETY: the symbol's type is its declaration in cuda.h, and
                // `lib` outlives the pointer (both live in the Driver).
                *unsafe { lib.get($name) }.map_err(|_| {
                    LoadError::TooOld(name.clone(), std::str::from_utf8(&$name[..$name.len() - 1]).unwrap_or("?"))
                })?
            };
        }
        Ok(Driver {
            init: sym!(b"cuInit\0"),
            driver_version: sym!(b"cuDriverGetVersion\0"),
            device_count: sym!(b"cuDeviceGetCount\0"),
            device_get: sym!(b"cuDeviceGet\0"),
            device_uuid: sym!(b"cuDeviceGetUuid_v2\0"),
            device_name: sym!(b"cuDeviceGetName\0"),
            error_name: sym!(b"cuGetErrorName\0"),
            get_state: sym!(b"cuCheckpointProcessGetState\0"),
            lock: sym!(b"cuCheckpointProcessLock\0"),
            checkpoint: sym!(b"cuCheckpointProcessCheckpoint\0"),
            restore: sym!(b"cuCheckpointProcessRestore\0"),
            unlock: sym!(b"cuCheckpointProcessUnlock\0"),
            _lib: lib,
        })
    }

    fn check(&self, call: &'static str, status: Status) -> Result<(), DriverError> {
        if status == 0 {
            return Ok(());
        }
        let mut s: *const c_char = std::ptr::null();
        // SAFETY: cuGetErrorName writes a pointer to a static string, or
        // leaves it null for an unknown code.
        let known = unsafe { (self.error_name)(status, &mut s) } == 0 && !s.is_null();
        let name = if known {
            // SAFETY: a NUL-terminated static string of the driver.
            unsafe { CStr::from_ptr(s) }.to_string_lossy().into_owned()
        } else {
            "unknown error".into()
        };
        Err(DriverError { call, code: status, name })
    }

    /// `cuInit`: a restore needs the driver initialised in the calling process
    /// (or persistence mode), and the GPU list needs it.
    pub fn init(&self) -> Result<(), DriverError> {
        // SAFETY: a plain call with flags 0.
        self.check("cuInit", unsafe { (self.init)(0) })
    }

    /// The driver's CUDA version (e.g. 12080 for 12.8).
    pub fn version(&self) -> Result<i32, DriverError> {
        let mut v = 0;
        // SAFETY: writes one int.
        self.check("cuDriverGetVersion", unsafe { (self.driver_version)(&mut v) })?;
        Ok(v)
    }

    /// The GPUs this machine's driver lists (after [`init`](Self::init)).
    pub fn gpus(&self) -> Result<Vec<Gpu>, DriverError> {
        let mut n = 0;
        // SAFETY: writes one int.
        self.check("cuDeviceGetCount", unsafe { (self.device_count)(&mut n) })?;
        let mut gpus = Vec::new();
        for ordinal in 0..n {
            let mut dev = 0;
            // SAFETY: writes one device handle (an int).
            self.check("cuDeviceGet", unsafe { (self.device_get)(&mut dev, ordinal) })?;
            let mut uuid = [0u8; 16];
            // SAFETY: writes 16 bytes.
            self.check("cuDeviceGetUuid", unsafe { (self.device_uuid)(&mut uuid, dev) })?;
            let mut name = [0 as c_char; 256];
            // SAFETY: writes at most 256 bytes, NUL-terminated.
            self.check("cuDeviceGetName", unsafe { (self.device_name)(name.as_mut_ptr(), 256, dev) })?;
            // SAFETY: NUL-terminated within the buffer (the driver truncates).
            let name = unsafe { CStr::from_ptr(name.as_ptr()) }.to_string_lossy().into_owned();
            gpus.push(Gpu { uuid: uuid_text(&uuid), name });
        }
        Ok(gpus)
    }

    /// The checkpoint state of process `pid`; an error for a process that
    /// does not use CUDA (the driver says `CUDA_ERROR_OPERATING_SYSTEM` or
    /// `CUDA_ERROR_NOT_INITIALIZED` then).
    pub fn state(&self, pid: i32) -> Result<ProcessState, DriverError> {
        let mut s = 0;
        // SAFETY: writes one int.
        self.check("cuCheckpointProcessGetState", unsafe { (self.get_state)(pid, &mut s) })?;
        Ok(match s {
            0 => ProcessState::Running,
            1 => ProcessState::Locked,
            2 => ProcessState::Checkpointed,
            _ => ProcessState::Failed,
        })
    }

    /// Locks `pid`'s CUDA calls, waiting up to `timeout_ms` for work it submitted.
    pub fn lock(&self, pid: i32, timeout_ms: u32) -> Result<(), DriverError> {
        let mut args = LockArgs { timeout_ms, reserved0: 0, reserved1: [0; 7] };
        // SAFETY: the args struct is cuda.h's, zeroed where reserved.
        self.check("cuCheckpointProcessLock", unsafe { (self.lock)(pid, &mut args) })
    }

    /// Copies `pid`'s device memory into its host memory and releases its GPUs.
    pub fn checkpoint(&self, pid: i32) -> Result<(), DriverError> {
        // SAFETY: null optional arguments are allowed.
        self.check("cuCheckpointProcessCheckpoint", unsafe { (self.checkpoint)(pid, std::ptr::null_mut()) })
    }

    /// Brings `pid`'s device memory back, onto the GPUs `pairs` name (old
    /// UUID, new UUID; every checkpointed GPU when not empty), else the same.
    pub fn restore(&self, pid: i32, pairs: &[(String, String)]) -> Result<(), DriverError> {
        let raw: Vec<GpuPair> = pairs
            .iter()
            .map(|(old, new)| GpuPair {
                old: uuid_bytes(old).unwrap_or_default(),
                new: uuid_bytes(new).unwrap_or_default(),
            })
            .collect();
        let status = if raw.is_empty() {
            // SAFETY: null optional arguments are allowed.
            unsafe { (self.restore)(pid, std::ptr::null_mut()) }
        } else {
            let mut args = RestoreArgs { pairs: raw.as_ptr(), count: raw.len() as c_uint, reserved: [0; 52] };
            // SAFETY: `raw` outlives the call; the struct is cuda.h's.
            unsafe { (self.restore)(pid, &mut args) }
        };
        self.check("cuCheckpointProcessRestore", status)
    }

    /// Lets `pid`'s CUDA calls run again.
    pub fn unlock(&self, pid: i32) -> Result<(), DriverError> {
        // SAFETY: null optional arguments are allowed.
        self.check("cuCheckpointProcessUnlock", unsafe { (self.unlock)(pid, std::ptr::null_mut()) })
    }
}

impl fmt::Debug for Driver {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Driver")
    }
}

/// A UUID as nvidia-smi prints it: `GPU-` and 8-4-4-4-12 hex digits.
pub fn uuid_text(u: &Uuid) -> String {
    let h: String = u.iter().map(|b| format!("{b:02x}")).collect();
    format!("GPU-{}-{}-{}-{}-{}", &h[..8], &h[8..12], &h[12..16], &h[16..20], &h[20..])
}

/// The bytes of a UUID in that form (with or without `GPU-`); None if it is
/// not one.
pub fn uuid_bytes(s: &str) -> Option<Uuid> {
    let hex: String = s.strip_prefix("GPU-").unwrap_or(s).chars().filter(|c| *c != '-').collect();
    if hex.len() != 32 {
        return None;
    }
    let mut u = [0u8; 16];
    for (i, b) in u.iter_mut().enumerate() {
        *b = u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).ok()?;
    }
    Some(u)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uuids_print_as_nvidia_smi_does_and_parse_back() {
        let u: Uuid = *b"\x01\x23\x45\x67\x89\xab\xcd\xef\x10\x32\x54\x76\x98\xba\xdc\xfe";
        let t = uuid_text(&u);
        assert_eq!(t, "GPU-01234567-89ab-cdef-1032-547698badcfe");
        assert_eq!(uuid_bytes(&t), Some(u));
        assert_eq!(uuid_bytes("GPU-0123"), None);
        assert_eq!(std::mem::size_of::<RestoreArgs>(), 64);
        assert_eq!(std::mem::size_of::<LockArgs>(), 64);
    }
}
