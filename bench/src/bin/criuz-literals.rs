//! Whether zstd's Huffman-coded literals could be left out block by block:
//! each block of a pages image (zero blocks skipped) compressed at one zstd
//! level with its literals Huffman-coded and stored raw, each frame decoded
//! a few times, timed. The blocks are then taken raw best first (most
//! decode time saved per stored byte added): if blocks differed, the first
//! ones would buy most of the time for little of the size. One core, no
//! CRIU: a measurement of the codec on a given image, not of criuz.

use clap::Parser;
use std::time::Instant;
use zstd::zstd_safe::{CParameter, ParamSwitch};

#[derive(Parser)]
#[command(about = "zstd literals, Huffman-coded or raw, block by block, on a pages image")]
struct Args {
    /// A pages image (`criu dump -D` writes pages-N.img) or any file.
    image: std::path::PathBuf,
    /// zstd level (criuz's default: 5).
    #[arg(long, default_value_t = 5)]
    level: i32,
    /// Block size in KiB (criuz's default: 256).
    #[arg(long, default_value_t = 256)]
    block_kib: usize,
    /// Decodes of each frame timed (the mean is taken).
    #[arg(long, default_value_t = 5)]
    decodes: u32,
}

/// One block's two frames: stored bytes and decode seconds.
struct Block {
    huffman: (f64, f64),
    raw: (f64, f64),
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args = Args::parse();
    let data = std::fs::read(&args.image).map_err(|e| format!("{}: {e}", args.image.display()))?;
    let mut huffman = zstd::bulk::Compressor::new(args.level)?;
    let mut raw = zstd::bulk::Compressor::new(args.level)?;
    raw.set_parameter(CParameter::LiteralCompressionMode(ParamSwitch::Disable))?;
    let mut decoder = zstd::bulk::Decompressor::new()?;
    let mut out = vec![0u8; args.block_kib << 10];
    let mut timed = |frame: &[u8]| -> Result<(f64, f64), std::io::Error> {
        let started = Instant::now();
        for _ in 0..args.decodes {
            decoder.decompress_to_buffer(frame, &mut out)?;
        }
        Ok((frame.len() as f64, started.elapsed().as_secs_f64() / f64::from(args.decodes)))
    };
    let mut blocks = Vec::new();
    for b in data.chunks(args.block_kib << 10).filter(|b| b.iter().any(|&x| x != 0)) {
        blocks.push(Block { huffman: timed(&huffman.compress(b)?)?, raw: timed(&raw.compress(b)?)? });
    }
    let total = |f: fn(&Block) -> (f64, f64)| blocks.iter().map(f).fold((0.0, 0.0), |a, x| (a.0 + x.0, a.1 + x.1));
    let (size, time) = total(|b| b.huffman);
    let (raw_size, raw_time) = total(|b| b.raw);
    let input = blocks.len() as f64 * (args.block_kib << 10) as f64;
    println!(
        "{} blocks: Huffman literals {:.4} of raw, decode {:.3} s; raw literals {:.4}, decode {:.3} s",
        blocks.len(),
        size / input,
        time,
        raw_size / input,
        raw_time
    );
    blocks.sort_by(|a, b| {
        let gain = |x: &Block| (x.huffman.1 - x.raw.1) / (x.raw.0 - x.huffman.0).max(1.0);
        gain(b).total_cmp(&gain(a))
    });
    println!("blocks raw (best first)  archive  decode time");
    let (mut s, mut t, mut taken) = (size, time, 0);
    for tenth in 1..=10 {
        while taken * 10 < blocks.len() * tenth {
            let b = &blocks[taken];
            s += b.raw.0 - b.huffman.0;
            t += b.raw.1 - b.huffman.1;
            taken += 1;
        }
        println!("{:>22}%  {:+6.2}%  {:+6.1}%", tenth * 10, (s / size - 1.0) * 100.0, (t / time - 1.0) * 100.0);
    }
    Ok(())
}
