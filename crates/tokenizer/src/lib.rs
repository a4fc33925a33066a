//! Tokenising like the engine (being written).
