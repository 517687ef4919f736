//! Tessera runtime: executes a plan (mesh, communication, backends, model layers, schedules).

pub mod alloc;
pub mod comm;
pub mod cpu;
pub mod data;
pub mod exec;
pub mod layers;
pub mod optim;
pub mod params;
pub mod rng;

#[cfg(test)]
mod testutil;
