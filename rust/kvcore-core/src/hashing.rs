//! Block hashing (SPEC §5): filled in by the hashing work.
