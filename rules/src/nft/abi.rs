//! nf_tables' message and attribute numbers (`linux/netfilter/nf_tables.h`) that our own byte
//! writers and readers use, where they step around the crates' generic encoder and parser
//! (`render`'s set elements, `read`'s rules and set elements): one place, so the writer and
//! the reader of a layout cannot drift apart.

/// `NFNL_SUBSYS_NFTABLES`: a message's type is `subsystem << 8 | NFT_MSG_*`.
pub const NFNL_SUBSYS_NFTABLES: u16 = 10;
/// `NFT_MSG_NEWRULE` and `NFT_MSG_NEWSETELEM`, with the subsystem.
pub const NEWRULE: u16 = (NFNL_SUBSYS_NFTABLES << 8) | 6;
pub const NEWSETELEM: u16 = (NFNL_SUBSYS_NFTABLES << 8) | 12;
/// `NFNL_BATCH_GENID`: the batch begin marker's attribute holding the ruleset generation the
/// netns must still be at (big-endian; 0: any).
pub const NFNL_BATCH_GENID: u16 = 1;
/// Where a guarded batch's generation is (`Batch::encode_guarded`): the value of the begin
/// marker's `NFNL_BATCH_GENID`, after the netlink header (16 bytes), the nfgenmsg (4) and
/// the attribute's own header (4).
pub const GUARD_AT: usize = 24;

/// `NFTA_RULE_*`.
pub const RULE_TABLE: u16 = 1;
pub const RULE_CHAIN: u16 = 2;
pub const RULE_EXPRESSIONS: u16 = 4;
pub const RULE_USERDATA: u16 = 7;

/// `NFTA_LIST_ELEM`: an item of a nested list (expressions, set elements).
pub const LIST_ELEM: u16 = 1;
/// `NFTA_EXPR_*`.
pub const EXPR_NAME: u16 = 1;
pub const EXPR_DATA: u16 = 2;

/// `NFTA_SET_ELEM_LIST_*`.
pub const SET_ELEM_LIST_TABLE: u16 = 1;
pub const SET_ELEM_LIST_SET: u16 = 2;
pub const SET_ELEM_LIST_ELEMENTS: u16 = 3;
pub const SET_ELEM_LIST_SET_ID: u16 = 4;
/// `NFTA_SET_ELEM_*`.
pub const ELEM_KEY: u16 = 1;
pub const ELEM_DATA: u16 = 2;
pub const ELEM_FLAGS: u16 = 3;
/// `NFTA_DATA_*`.
pub const DATA_VALUE: u16 = 1;
pub const DATA_VERDICT: u16 = 2;
/// `NFTA_VERDICT_*`.
pub const VERDICT_CODE: u16 = 1;
pub const VERDICT_CHAIN: u16 = 2;

/// `NFTA_OBJ_*`, `NFTA_COUNTER_*`: a named counter object.
pub const OBJ_TABLE: u16 = 1;
pub const OBJ_NAME: u16 = 2;
pub const OBJ_TYPE: u16 = 3;
pub const OBJ_DATA: u16 = 4;
pub const COUNTER_BYTES: u16 = 1;
pub const COUNTER_PACKETS: u16 = 2;

/// Rule user data: a TLV list of (type u8, length u8, value); type 0 is the comment, a
/// NUL-terminated string (libnftnl's layout, which `nft` reads).
pub const UDATA_RULE_COMMENT: u8 = 0;
