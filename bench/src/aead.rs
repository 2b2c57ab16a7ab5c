//! `--aead`: what sealing costs per core, for the choice of AEAD in
//! `criuz::seal`. Seals and opens 256 MiB in 256 KiB blocks (the default
//! block size) on one thread with each candidate from `ring`, best of three
//! passes, and reports GB/s. The data is pseudo-random: an AEAD's speed does
//! not depend on the bytes.

use ring::aead::{Aad, Algorithm, LessSafeKey, Nonce, UnboundKey, AES_256_GCM, CHACHA20_POLY1305};
use std::time::Instant;

#[derive(serde::Serialize)]
pub struct Row {
    pub aead: &'static str,
    pub seal_gb_s: f64,
    pub open_gb_s: f64,
}

const BLOCK: usize = 256 << 10;
const TOTAL: usize = 256 << 20;

fn nonce(i: usize) -> Nonce {
    let mut n = [0u8; 12];
    n[4..12].copy_from_slice(&(i as u64).to_le_bytes());
    Nonce::assume_unique_for_key(n)
}

fn measure(name: &'static str, alg: &'static Algorithm) -> Row {
    let key = LessSafeKey::new(UnboundKey::new(alg, &[7u8; 32]).expect("32-byte key"));
    let mut x = 0x9E37_79B9_7F4A_7C15u64;
    let mut blocks: Vec<Vec<u8>> = (0..TOTAL / BLOCK)
        .map(|_| {
            (0..BLOCK)
                .map(|_| {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    x as u8
                })
                .collect()
        })
        .collect();
    let (mut seal, mut open) = (f64::MAX, f64::MAX);
    for _ in 0..3 {
        let t = Instant::now();
        let tags: Vec<_> = blocks
            .iter_mut()
            .enumerate()
            .map(|(i, b)| key.seal_in_place_separate_tag(nonce(i), Aad::from(b"ad"), b).expect("seal"))
            .collect();
        seal = seal.min(t.elapsed().as_secs_f64());
        let t = Instant::now();
        for (i, (b, tag)) in blocks.iter_mut().zip(tags).enumerate() {
            key.open_in_place_separate_tag(nonce(i), Aad::from(b"ad"), tag, b, 0..).expect("open");
        }
        open = open.min(t.elapsed().as_secs_f64());
    }
    let gb = TOTAL as f64 / 1e9;
    Row { aead: name, seal_gb_s: gb / seal, open_gb_s: gb / open }
}

pub fn rows() -> Vec<Row> {
    vec![measure("AES-256-GCM (ring)", &AES_256_GCM), measure("ChaCha20-Poly1305 (ring)", &CHACHA20_POLY1305)]
}

pub fn table(rows: &[Row]) -> String {
    let mut s = format!("{:<26} {:>10} {:>10}\n", "aead, one core", "seal GB/s", "open GB/s");
    for r in rows {
        s += &format!("{:<26} {:>10.2} {:>10.2}\n", r.aead, r.seal_gb_s, r.open_gb_s);
    }
    s
}
