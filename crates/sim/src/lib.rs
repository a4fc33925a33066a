//! kvroute-sim (being written).
