//! Tessera runtime: executes a plan (mesh, communication, backends, model layers, schedules).

pub mod alloc;
pub mod backend;
pub mod calibrate;
pub mod checkpoint;
pub mod comm;
pub mod comm_parity;
pub mod data;
pub mod exec;
pub mod hf;
pub mod launch;
pub mod layers;
pub mod optim;
pub mod params;
pub mod quant;
pub mod rng;
pub mod session;

#[cfg(test)]
mod testutil;
