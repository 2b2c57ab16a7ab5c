//! `criuz bench` (being written).

#[derive(clap::Args, Clone, Debug)]
pub struct BenchArgs {}

pub fn run(_args: &BenchArgs) -> crate::Result<()> {
    Err(crate::Error::Invalid("bench is not built yet".into()))
}
