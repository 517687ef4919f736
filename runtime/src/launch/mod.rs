//! Running one process per rank: the launch environment ([`env`]), the rendezvous that hands
//! rank 0's blob (NCCL ids) to the others ([`rendezvous`]), and the supervisor behind
//! `tessera launch` that starts the local ranks and stops them all when one fails
//! ([`supervise`]). None of it needs a GPU; all of it is tested on loopback.

pub mod env;
pub mod rendezvous;
pub mod supervise;

use std::io::Read;

/// Exit code of a rank that stopped because rank 0 reported a failure (the cause is rank 0's,
/// not this rank's): the supervisor prefers another rank's error when it has one.
pub const EXIT_PEER_FAILED: u8 = 3;

/// A fresh random token (32 hex digits) from the OS; falls back to the clock and process id
/// where /dev/urandom is unavailable.
pub fn new_token() -> String {
    let mut bytes = [0u8; 16];
    let read = std::fs::File::open("/dev/urandom").and_then(|mut f| f.read_exact(&mut bytes));
    if read.is_err() {
        let t = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos());
        let seed = crate::rng::mix64(t as u64 ^ (u64::from(std::process::id()) << 32));
        bytes[..8].copy_from_slice(&seed.to_le_bytes());
        bytes[8..].copy_from_slice(&crate::rng::mix64(seed).to_le_bytes());
    }
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// A TCP port that was free on `host` a moment ago (bind port 0, read it, close). Another
/// process may take it before rank 0 binds it; rank 0 then fails with a clear error.
pub fn free_port(host: &str) -> std::io::Result<u16> {
    Ok(std::net::TcpListener::bind((host, 0))?.local_addr()?.port())
}
