//! Tessera runtime: executes a plan (mesh, communication, backends, model layers, schedules).
