//! nf_tables' registers as rules name them (`linux/netfilter/nf_tables.h`): the numbers both
//! the expression encoders and the key layouts use, so neither imports the other.

/// A register number (`NFT_REG_*`, `NFT_REG32_*`).
pub type Reg = u32;
pub const REG_VERDICT: Reg = 0;
pub const REG_1: Reg = 1;
pub const REG_2: Reg = 2;
