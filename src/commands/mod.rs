//! One module per subcommand: build the options, call a library function, print.

pub mod calibrate;
pub mod calibrate_gpu;
pub mod calibrate_host;
pub mod checkpoint;
pub mod data;
pub mod diff;
pub mod doctor;
pub mod explain;
pub mod export;
pub mod launch;
pub mod plan;
pub mod replan;
pub mod repredict;
pub mod run;
pub mod sample;
pub mod validate;
pub mod validate_planner;
