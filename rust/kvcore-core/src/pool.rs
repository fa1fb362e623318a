//! The block pool (SPEC §1–4).
