//! The device through cudarc.
