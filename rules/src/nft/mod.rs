//! nftables over netlink, in pure Rust: program a table in one transaction, delete it,
//! read it back. Messages are built and parsed with `netlink-packet-netfilter` (plus small
//! encoders of ours in `expr`), and sent over the crate's one netlink conversation layer.

mod abi;
pub(crate) mod expr;
pub mod key;
mod notation;
pub mod read;
mod reg;
mod render;
mod wire;

pub use expr::{Expr, Exprs, Reg};
pub(crate) use render::counter_removed;
pub use render::{ElementChange, TableChange};

use std::collections::BTreeMap;
use std::io;

use netlink_packet_core::{NetlinkMessage, NetlinkPayload, NlasIterator};
use netlink_packet_netfilter::nftables::{
    GenAttribute, GenMessage, NfTablesMessage, RuleAttribute, RuleMessage, SetAttribute, SetElementList,
    SetElementMessage, SetMessage, TableAttribute, TableMessage,
};
use netlink_packet_netfilter::{NetfilterHeader, NetfilterMessage, NetfilterMessageInner, NetfilterProtoFamily};

use crate::error::{Error, Result};
use crate::family::Family;
use crate::model::Table;
use crate::netlink::{Socket, NETLINK_NETFILTER};
use read::TableView;
use render::{Batch, Existing};

/// What one error reply to a batch message costs the receive buffer (the skb's truesize,
/// generously): room for all of them, so a refused large batch's answers never overflow.
const ERROR_TRUESIZE: usize = 1024;

fn open() -> Result<NftSocket> {
    Socket::open(NETLINK_NETFILTER)
        .map(|s| NftSocket(Some(s)))
        .map_err(|source| Error::Nftables { op: "open socket", source })
}

/// A netfilter socket: dropped while a [`CloseLater`] of this thread is alive, it is closed
/// with the others then (closing one waits for the kernel's pending destruction of deleted
/// objects, whichever socket deleted them: see there).
struct NftSocket(Option<Socket>);

impl std::ops::Deref for NftSocket {
    type Target = Socket;
    fn deref(&self) -> &Socket {
        self.0.as_ref().expect("open until dropped")
    }
}

impl std::ops::DerefMut for NftSocket {
    fn deref_mut(&mut self) -> &mut Socket {
        self.0.as_mut().expect("open until dropped")
    }
}

impl Drop for NftSocket {
    fn drop(&mut self) {
        if let Some(sock) = self.0.take() {
            close_later(sock);
        }
    }
}

/// Sends `batch` as one transaction and waits for the kernel's verdict. No message asks for
/// an ACK (errors are reported anyway); a GETGEN request after the batch is the fence: its
/// answer comes after every answer to the batch. An error names the refused object.
fn commit(sock: &mut Socket, batch: &Batch) -> Result<()> {
    commit_at(sock, batch).map(drop)
}

/// `commit`, and the netns's ruleset generation its fence read right after it (`None` if
/// that answer could not be read: the transaction's verdict stands).
fn commit_at(sock: &mut Socket, batch: &Batch) -> Result<Option<u32>> {
    let first = sock.take_seqs(batch.seq_count());
    commit_bytes(sock, batch, batch.encode(first), first)
}

/// `commit_at` of `batch` encoded from sequence number 0 (`bytes_at_zero`), renumbered for
/// this socket: a change sent to 100 pods is encoded once.
fn commit_encoded(sock: &mut Socket, batch: &Batch, bytes_at_zero: &[u8]) -> Result<Option<u32>> {
    let first = sock.take_seqs(batch.seq_count());
    let mut bytes = bytes_at_zero.to_vec();
    crate::netlink::renumber(&mut bytes, first);
    commit_bytes(sock, batch, bytes, first)
}

/// Sends the encoded `batch` (its bytes numbered for this socket), its answers given room
/// in the receive buffer.
fn send_batch(sock: &mut Socket, batch: &Batch, bytes: Vec<u8>) -> Result<()> {
    let nft = |op| move |source| Error::Nftables { op, source };
    sock.grow_buffer(libc::SO_RCVBUFFORCE, batch.labels.len() * ERROR_TRUESIZE).map_err(nft("size a socket buffer"))?;
    sock.send(&bytes).map_err(nft("send transaction"))
}

/// Sends the encoded `batch` (its first sequence number `first`), then the fence.
fn commit_bytes(sock: &mut Socket, batch: &Batch, bytes: Vec<u8>, first: u32) -> Result<Option<u32>> {
    let nft = |op| move |source| Error::Nftables { op, source };
    send_batch(sock, batch, bytes)?;
    let fence = sock.take_seqs(1);
    let mut request = generation_request().to_vec();
    crate::netlink::renumber(&mut request, fence);
    sock.send(&request).map_err(nft("send generation fence"))?;
    let (errors, answer) = sock.batch_errors_and_fence(fence).map_err(nft("generation fence"))?;
    if errors.is_empty() {
        return Ok(generation_of(&answer).ok());
    }
    Err(refusal(batch, first, &errors))
}

/// The error of a batch (its first sequence number `first`) the kernel refused with
/// `errors` (not empty): naming the first refused object, and every kernel feature the
/// refused objects need and the running kernel lacks.
fn refusal(batch: &Batch, first: u32, errors: &[(u32, i32)]) -> Error {
    let (seq, code) = errors[0];
    let index = |seq: u32| seq.checked_sub(first + 1).map(|i| i as usize);
    let what = index(seq).and_then(|i| batch.labels.get(i)).map(String::as_str).unwrap_or("the transaction");
    let source = io::Error::from_raw_os_error(code);
    // A kernel without a feature refuses each object that needs it: name every feature it
    // lacks among those the refused objects need, and which Linux has it.
    let kernel = crate::features::Kernel::running();
    let mut missing: Vec<&'static crate::features::Feature> = Vec::new();
    for &(seq, code) in errors {
        let needs = index(seq).and_then(|i| batch.needs.get(i)).map(Vec::as_slice).unwrap_or(&[]);
        for f in crate::features::missing(&kernel, needs, code) {
            if !missing.contains(&f) {
                missing.push(f);
            }
        }
    }
    if missing.is_empty() {
        return Error::Transaction { object: what.to_string(), source };
    }
    Error::MissingFeature { object: what.to_string(), missing, release: kernel.release, source }
}

/// What a guarded send did ([`Encoded::send_guarded_on`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Guarded {
    /// Committed: the netns's ruleset generation after it (the guard's next), known without
    /// asking, since nothing else committed in between.
    Committed(u32),
    /// Not sent: something else committed in the netns since the guard's generation.
    Stale,
}

/// Sends `batch` guarded by `generation` (`bytes_at_zero`: `Batch::encode_guarded(0)`,
/// renumbered for this socket and given the generation) and waits for its ACK.
fn commit_guarded(sock: &mut Socket, batch: &Batch, bytes_at_zero: &[u8], generation: u32) -> Result<Guarded> {
    let nft = |op| move |source| Error::Nftables { op, source };
    let first = sock.take_seqs(batch.seq_count());
    let mut bytes = bytes_at_zero.to_vec();
    crate::netlink::renumber(&mut bytes, first);
    bytes[abi::GUARD_AT..abi::GUARD_AT + 4].copy_from_slice(&generation.to_be_bytes());
    send_batch(sock, batch, bytes)?;
    let last = first + batch.seq_count() - 2;
    let errors = sock.batch_errors_until_ack(first, last).map_err(nft("transaction acknowledgement"))?;
    match errors.first() {
        None => {
            // The kernel's generation counter skips 0 (0 asks for no guard).
            let next = generation.wrapping_add(1);
            Ok(Guarded::Committed(if next == 0 { 1 } else { next }))
        }
        Some(&(seq, code)) if seq == first && code == libc::ERESTART => Ok(Guarded::Stale),
        Some(_) => Err(refusal(batch, first, &errors)),
    }
}

/// A GETGEN request, encoded once (sequence number 0).
fn generation_request() -> &'static [u8] {
    static BYTES: std::sync::OnceLock<Vec<u8>> = std::sync::OnceLock::new();
    BYTES.get_or_init(|| crate::netlink::encode(generation_message(), 0, 0))
}

/// A GETGEN request.
fn generation_message() -> NetfilterMessage {
    NetfilterMessage::new(
        NetfilterHeader::new(NetfilterProtoFamily::Unspec, 0, 0),
        NfTablesMessage::GetGen(GenMessage { attributes: vec![] }),
    )
}

/// Runs a dump and parses its messages. A message that does not parse is skipped when it
/// is not about `table` (someone else's, with attributes newer than the crate) and is an
/// error when it is (CHECK must not pass over what it cannot read).
/// Dumps are of one family: the kernel reports only tables of the family the request names.
fn dump(
    sock: &mut Socket,
    family: Family,
    request: NfTablesMessage,
    table: &str,
    op: &'static str,
) -> Result<Vec<NfTablesMessage>> {
    let raw = match sock.dump_raw(render::message(family, request)) {
        Ok(r) => r,
        // No such table (or set): nothing to dump.
        Err(e) if e.raw_os_error() == Some(libc::ENOENT) => return Ok(Vec::new()),
        Err(source) => return Err(Error::Nftables { op, source }),
    };
    let mut out = Vec::with_capacity(raw.len());
    for bytes in &raw {
        match parse(bytes) {
            Ok(m) => out.extend(m),
            Err(e) if names_table(bytes, table) => {
                return Err(Error::Nftables { op, source: io::Error::new(io::ErrorKind::InvalidData, e.to_string()) })
            }
            Err(_) => {}
        }
    }
    Ok(out)
}

/// One nftables message, parsed (`None` for other subsystems).
fn parse(bytes: &[u8]) -> std::result::Result<Option<NfTablesMessage>, netlink_packet_core::DecodeError> {
    if let Some(m) = read::fast_elements(bytes).or_else(|| read::fast_rule(bytes)) {
        return Ok(Some(m));
    }
    Ok(match NetlinkMessage::<NetfilterMessage>::deserialize(bytes)?.payload {
        NetlinkPayload::InnerMessage(NetfilterMessage { inner: NetfilterMessageInner::NfTables(m), .. }) => Some(m),
        _ => None,
    })
}

/// Whether a raw nftables message's first attribute (the table, for every kind we dump)
/// is `table`.
fn names_table(bytes: &[u8], table: &str) -> bool {
    const HEADERS: usize = 16 + 4;
    let Some(attrs) = bytes.get(HEADERS..) else { return false };
    NlasIterator::new(attrs).flatten().any(|a| a.kind() == 1 && a.value().strip_suffix(&[0]) == Some(table.as_bytes()))
}

/// Makes the current netns hold exactly `table` (creating it, or replacing one already
/// there), in one transaction.
#[cfg(test)]
pub(crate) fn program(table: &Table) -> Result<()> {
    program_keeping(table, &BTreeMap::new())
}

/// Like `program`, with the named counters starting from the given values.
///
/// The common case, a fresh pod netns, has no such table: one lookup (a GETTABLE dump on the
/// same socket, tens of microseconds) lets the transaction simply create it. Only when the
/// table is there is it replaced by add/delete/add, atomically; that delete costs the kernel
/// an RCU grace period (milliseconds), which a fresh ADD thus never pays.
///
/// Between the lookup and the commit another writer could create the table (the runtime
/// never runs two operations for one container at once, so this is some other program). The
/// create is exclusive (`NLM_F_EXCL`), so then the kernel refuses the whole transaction and
/// changes nothing, and the table is replaced instead: never two rulesets merged into one.
/// A table deleted in that window is harmless: the replace creates it first.
pub(crate) fn program_keeping(table: &Table, counters: &Counts) -> Result<()> {
    let mut sock = open()?;
    let exists = table_flags(&mut sock, table.family, &table.name)?.is_some();
    program_on(&mut sock, table, counters, exists)
}

/// Makes the current netns hold exactly `tables` (a pod's IPv4 and IPv6 halves), all in
/// one transaction: the kernel applies both or neither. Each is created, or replaced if
/// there, as `program` does for one.
pub(crate) fn program_tables(tables: &[&Table]) -> Result<()> {
    program_tables_keeping(tables, &BTreeMap::new(), &[], &[])
}

/// `program_tables`, with the named counters of each family's table starting from the given
/// values, and the `retired` tables (family, name) deleted in the same transaction (a Service layer rebuilt when the snapshot's families change: what the
/// retired table counted is carried into `counters` by the caller, never counted twice).
/// The `asserted` counters (family, table, name), which the caller read in the tables it replaces,
/// are deleted first: the kernel refuses the whole transaction, at one of them, when the
/// tables no longer hold it (another writer changed them since the reading).
pub(crate) fn program_tables_keeping(
    tables: &[&Table],
    counters: &BTreeMap<Family, Counts>,
    retired: &[(Family, &str)],
    asserted: &[(Family, &str, &str)],
) -> Result<()> {
    let none = Counts::new();
    let counts = |t: &Table| counters.get(&t.family).unwrap_or(&none);
    if let ([table], [], []) = (tables, retired, asserted) {
        return program_keeping(table, counts(table));
    }
    let mut sock = open()?;
    let mut plan = Vec::with_capacity(tables.len());
    for t in tables {
        let exists = table_flags(&mut sock, t.family, &t.name)?.is_some();
        plan.push((*t, counts(t), if exists { Existing::Replace } else { Existing::Refuse }));
    }
    // The names asserted first, the tables, then the retired tables deleted.
    let whole = |batch: render::Batch| {
        let mut b = render::Batch::default();
        for &(family, table, name) in asserted {
            render::delete_counter(&mut b, family, table, name);
        }
        b.append(batch);
        for (family, name) in retired {
            b.append(render::delete_table(*family, name));
        }
        b
    };
    match commit(&mut sock, &whole(render::tables_batch(&plan))) {
        // One appeared since the lookup: replace them all instead.
        Err(Error::Transaction { object, source })
            if source.raw_os_error() == Some(libc::EEXIST)
                && tables.iter().any(|t| object == render::table_label(t.family, &t.name)) =>
        {
            let replace: Vec<_> = tables.iter().map(|t| (*t, counts(t), Existing::Replace)).collect();
            commit(&mut sock, &whole(render::tables_batch(&replace)))
        }
        other => other,
    }
}

/// The current netns's nftables generation (`NFT_MSG_GETGEN`): the kernel adds one with every
/// transaction committed in the netns (any table, any family, any writer), and with nothing
/// else: dumps, counters counting and the datapath updating a dynamic set leave it as it was.
/// An unchanged generation thus says that no table of the netns was changed since it was
/// read. It is the netns's own (every netns starts again from its own first value), so it
/// is only comparable within one netns: a caller keys it by the namespace's cookie.
pub fn generation() -> Result<u32> {
    KeptSocket::open()?.generation()
}

/// The generation in an answer to GETGEN.
fn generation_of(bytes: &[u8]) -> Result<u32> {
    let err = |source| Error::Nftables { op: "get generation", source };
    let invalid = |what: String| err(io::Error::new(io::ErrorKind::InvalidData, what));
    let message = NetlinkMessage::<NetfilterMessage>::deserialize(bytes).map_err(|e| invalid(e.to_string()))?;
    match message.payload {
        NetlinkPayload::InnerMessage(NetfilterMessage {
            inner: NetfilterMessageInner::NfTables(NfTablesMessage::NewGen(GenMessage { attributes })),
            ..
        }) => attributes
            .iter()
            .find_map(|a| match a {
                GenAttribute::Id(id) => Some(*id),
                _ => None,
            })
            .ok_or_else(|| invalid("the generation answer has no id".into())),
        _ => Err(invalid("the answer to GETGEN is not a generation".into())),
    }
}

/// Named counters' (packets, bytes), by name.
pub type Counts = BTreeMap<String, (u64, u64)>;

/// `program_keeping` once the lookup said whether the table `exists` (which may no longer
/// be true when the transaction commits).
fn program_on(sock: &mut Socket, table: &Table, counters: &BTreeMap<String, (u64, u64)>, exists: bool) -> Result<()> {
    if exists {
        return commit(sock, &render::table_batch_keeping(table, counters, Existing::Replace));
    }
    match commit(sock, &render::table_batch_keeping(table, counters, Existing::Refuse)) {
        Err(Error::Transaction { object, source })
            if source.raw_os_error() == Some(libc::EEXIST)
                && object == render::table_label(table.family, &table.name) =>
        {
            commit(sock, &render::table_batch_keeping(table, counters, Existing::Replace))
        }
        other => other,
    }
}

/// The transaction that creates `table` (which must not exist yet), encoded once, so that a
/// benchmark can time the kernel's own work alone: the floor any ADD of it pays.
pub struct Encoded(Batch, std::sync::OnceLock<Vec<u8>>, std::sync::OnceLock<Vec<u8>>);

pub fn encode(table: &Table) -> Encoded {
    encode_tables(&[table])
}

/// The transaction that creates all of `tables` (none may exist yet), encoded once.
pub fn encode_tables(tables: &[&Table]) -> Encoded {
    let none = Counts::new();
    Encoded::new(render::tables_batch(&tables.iter().map(|t| (*t, &none, Existing::Refuse)).collect::<Vec<_>>()))
}

impl Encoded {
    fn new(batch: Batch) -> Self {
        Encoded(batch, std::sync::OnceLock::new(), std::sync::OnceLock::new())
    }

    /// The batch's bytes from sequence number 0, encoded on first use and kept (for a
    /// change sent to many pods' kept sockets).
    fn bytes(&self) -> &[u8] {
        self.1.get_or_init(|| self.0.encode(0))
    }

    /// Sends the transaction in the current netns and waits for the kernel's verdict.
    pub fn send(&self) -> Result<()> {
        let mut sock = open()?;
        // Encoded for this send: a whole layer's batch, sent once, is not kept as bytes
        // beside itself (ADD's memory), unless kept already (`bytes_at_zero`).
        match self.1.get() {
            Some(bytes) => commit_encoded(&mut sock, &self.0, bytes).map(drop),
            None => commit(&mut sock, &self.0),
        }
    }

    /// The transaction's bytes from sequence number 0, and how many sequence numbers it
    /// takes: what a cache keeps to send it again from another process (`send_bytes`).
    pub fn bytes_at_zero(&self) -> (&[u8], u32) {
        (self.bytes(), self.0.seq_count())
    }

    /// Sends the transaction on `sock` (in the netns it was opened in) and waits for the
    /// kernel's verdict; the netns's ruleset generation right after it, when read.
    pub fn send_on(&self, sock: &mut KeptSocket) -> Result<Option<u32>> {
        commit_encoded(&mut sock.0, &self.0, self.bytes())
    }

    /// `send_on`, guarded by the netns's ruleset `generation` (as a fence or an earlier
    /// guarded send on this socket read it): refused whole, unsent, when anything committed
    /// there since ([`Guarded::Stale`]); else committed or refused as `send_on`'s, fenced by
    /// the kernel's ACK of its last message instead of a request after it.
    pub fn send_guarded_on(&self, sock: &mut KeptSocket, generation: u32) -> Result<Guarded> {
        let bytes = self.2.get_or_init(|| self.0.encode_guarded(0));
        commit_guarded(&mut sock.0, &self.0, bytes, generation)
    }
}

/// Sends a transaction kept as bytes from sequence number 0 (`Encoded::bytes_at_zero`, by
/// a process before this one; renumbered in place) in the current netns, and waits for the kernel's verdict. The
/// bytes carry no labels: a refusal names no object, and the caller falls back to the model,
/// which does.
pub fn send_bytes(mut bytes: Vec<u8>, seq_count: u32) -> Result<()> {
    let batch = Batch::unlabelled(seq_count.saturating_sub(2) as usize);
    let mut sock = open()?;
    let first = sock.take_seqs(seq_count);
    crate::netlink::renumber(&mut bytes, first);
    commit_bytes(&mut sock, &batch, bytes, first).map(drop)
}

/// A netfilter socket opened in one netns and kept open for many transactions there (a
/// socket stays in the netns it was opened in, whichever netns its user is in later), so a
/// long-lived process sends to a pod netns without entering it or opening a socket. While
/// open it keeps that netns alive: its owner closes it when the pod goes.
pub struct KeptSocket(NftSocket);

impl KeptSocket {
    /// A socket in the current netns.
    pub fn open() -> Result<Self> {
        open().map(KeptSocket)
    }
}

impl KeptSocket {
    /// The ruleset generation of the socket's netns (GETGEN).
    pub fn generation(&mut self) -> Result<u32> {
        let bytes =
            self.0.ask_raw(generation_message()).map_err(|source| Error::Nftables { op: "get generation", source })?;
        generation_of(&bytes)
    }

    /// [`counters_each`] on this socket.
    pub fn counters_each(&mut self, families: &[Family], table: &str) -> Result<Vec<Counts>> {
        counters_each_on(&mut self.0, families, table)
    }
}

impl std::fmt::Debug for KeptSocket {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("KeptSocket")
    }
}

thread_local! {
    /// The netfilter sockets whose closing a [`CloseLater`] of this thread puts off.
    static LATER: std::cell::RefCell<Option<Vec<netlink_sys::Socket>>> = const { std::cell::RefCell::new(None) };
}

/// The most sockets put off at once (descriptors); then they are closed together.
const MAX_LATER: usize = 256;

/// While alive, every netfilter socket this thread lets go of is closed when it is dropped,
/// together, instead of each after its work. Closing a netfilter socket
/// waits for the kernel's pending destruction of deleted objects (an RCU grace period,
/// 10-25 ms: docs/benchmarks.md, "DEL's floor"): a change that deletes elements in 100 pod
/// netns would wait 100 grace periods one after another, and waits about one this way (the
/// first close flushes all that is pending; the others find nothing to wait for). A socket
/// keeps its netns after the thread has left it.
pub struct CloseLater {
    outer: Option<Vec<netlink_sys::Socket>>,
}

impl CloseLater {
    #[allow(clippy::new_without_default)]
    pub fn new() -> Self {
        CloseLater { outer: LATER.with(|l| l.replace(Some(Vec::new()))) }
    }

    /// Ends this put-off without closing its sockets: they are the caller's, closed when the
    /// [`OpenSockets`] is dropped (or by whichever process holds them last).
    pub fn into_open(mut self) -> OpenSockets {
        let put_off = LATER.with(|l| l.replace(self.outer.take()));
        // (Its drop would put back an outer put-off again: it holds nothing now.)
        std::mem::forget(self);
        // `new` put a list there, and an inner put-off puts it back when it ends; none is
        // there only when this thread's put-offs ended out of their order, which no caller
        // does: nothing was kept for this one then, so there is nothing to hand over.
        OpenSockets(put_off.unwrap_or_default())
    }
}

impl Drop for CloseLater {
    fn drop(&mut self) {
        let put_off = LATER.with(|l| l.replace(self.outer.take()));
        drop(put_off);
    }
}

/// Netfilter sockets a [`CloseLater`] put off, still open: dropping them closes them, and the
/// last close waits for the kernel's destruction of what was deleted. A process that forks
/// while holding them shares them with its child, so the process that closes them last is
/// the one that waits (DEL's plugin hands them to a child after its answer).
#[must_use = "dropping them closes them, waiting for the kernel's destruction of what was deleted"]
pub struct OpenSockets(Vec<netlink_sys::Socket>);

impl OpenSockets {
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

/// A transaction's socket, done with: closed now, or kept (without its receive buffer) for
/// the [`CloseLater`] of this thread.
fn close_later(sock: Socket) {
    LATER.with(|l| match l.borrow_mut().as_mut() {
        Some(put_off) => {
            if put_off.len() >= MAX_LATER {
                put_off.clear();
            }
            put_off.push(sock.into_bare());
        }
        None => drop(sock),
    })
}

/// Changes the tables named `table` in the given families (chains added and removed whole,
/// set elements deleted and added), all in one transaction; nothing else changes.
pub(crate) fn change_tables(table: &str, changes: &[(Family, TableChange)]) -> Result<()> {
    if changes.iter().all(|(_, c)| c.is_empty()) {
        return Ok(());
    }
    encode_table_changes(table, changes).send()
}

/// The transaction of `change_tables`, encoded once (to be sent to many netns).
pub(crate) fn encode_table_changes(table: &str, changes: &[(Family, TableChange)]) -> Encoded {
    let mut batch = render::Batch::default();
    for (family, c) in changes {
        batch.append(render::table_change(*family, table, c));
    }
    Encoded::new(batch)
}

fn obj_request(table: &str) -> NfTablesMessage {
    NfTablesMessage::GetObject(vec![
        expr::str_attr(1 /* NFTA_OBJ_TABLE */, table),
        expr::u32_attr(3 /* NFTA_OBJ_TYPE */, expr::NFT_OBJECT_COUNTER),
    ])
}

/// The named counters of `family`'s table `table` in the current netns (empty when there is
/// no such table).
pub fn counters(family: Family, table: &str) -> Result<Counts> {
    Ok(counters_each(&[family], table)?.remove(0))
}

/// [`counters`] of `table` in each of `families`, in that order, read on one socket (a
/// socket made and closed is a good share of a small dump's cost).
pub fn counters_each(families: &[Family], table: &str) -> Result<Vec<Counts>> {
    counters_each_on(&mut *open()?, families, table)
}

fn counters_each_on(sock: &mut Socket, families: &[Family], table: &str) -> Result<Vec<Counts>> {
    let mut out = Vec::with_capacity(families.len());
    for &family in families {
        let objs = dump(sock, family, obj_request(table), table, "dump counters")?;
        out.push(TableView::from_messages(table, &objs).counters);
    }
    Ok(out)
}

/// The raw elements of one set of `table`. Dumps that set's elements
/// only (empty when the table or the set is missing), so reading a small set of a large
/// table costs what the small set holds.
pub fn set_elements(family: Family, table: &str, set: &str) -> Result<Vec<key::RawElement>> {
    let messages = dump_elements(&mut *open()?, family, table, set)?;
    let mut out = Vec::new();
    for m in &messages {
        if let NfTablesMessage::NewSetElement(e) = m {
            if let Some((name, elems)) = read::parse_elements(&e.attributes, table) {
                if name == set {
                    out.extend(elems);
                }
            }
        }
    }
    Ok(out)
}

/// The raw elements `elements` of the model set `set` are sent as: what `ElementChange`
/// carries.
pub fn set_keys(set: &crate::model::Set, elements: &[crate::model::Element]) -> Vec<key::RawElement> {
    key::element_keys(set, elements)
}

/// The set `set` of `family`'s table `table` in the current netns, without its elements
/// (its flags, key and data types; `None`: no such table or set). Dumps the table's sets only.
pub fn set_kind(family: Family, table: &str, set: &str) -> Result<Option<read::SetView>> {
    let messages = dump(&mut *open()?, family, set_request(table), table, "dump sets")?;
    Ok(TableView::from_messages(table, &messages).sets.into_iter().find(|s| s.name == set))
}

fn set_request(table: &str) -> NfTablesMessage {
    NfTablesMessage::GetSet(SetMessage { attributes: vec![SetAttribute::Table(table.to_string())] })
}

/// How often a set's elements are read again when their dump named an element twice.
const ELEMENT_DUMP_ATTEMPTS: u32 = 6;

/// The element messages of `table`'s set `set`, each element once. The kernel resumes a
/// set's dump, chunk after chunk, by skipping as many elements as it already sent; when it
/// resizes the set's hash table between two chunks (in a worker, soon after a large insert)
/// the order changes, and the dump sends some elements twice and misses as many, flagging
/// nothing. A dump that names no element twice has missed none (it sends as many elements
/// as the set holds), so such a dump is read again, after the worker had a moment.
fn dump_elements(sock: &mut Socket, family: Family, table: &str, set: &str) -> Result<Vec<NfTablesMessage>> {
    const OP: &str = "dump set elements";
    for attempt in 0..ELEMENT_DUMP_ATTEMPTS {
        let messages = dump(sock, family, elements_request(table, set), table, OP)?;
        if !read::names_an_element_twice(&messages, table) {
            return Ok(messages);
        }
        std::thread::sleep(std::time::Duration::from_millis(1 << attempt));
    }
    let why = format!("set {set}'s dump named an element twice {ELEMENT_DUMP_ATTEMPTS} times in a row (its hash table kept being resized)");
    Err(Error::Nftables { op: OP, source: io::Error::other(why) })
}

fn elements_request(table: &str, set: &str) -> NfTablesMessage {
    NfTablesMessage::GetSetElement(SetElementMessage {
        attributes: vec![SetElementList::Table(table.to_string()), SetElementList::Set(set.to_string())],
    })
}

/// Deletes the table; `Ok(false)` when it was not there.
///
/// Looked up first: a transaction the kernel refuses (deleting a missing table) is aborted,
/// and an abort costs an RCU grace period, so a DEL of nothing cost more (~15 ms) than a DEL
/// of the table; now it costs the lookup (~0.1 ms). Deleting a table costs a grace period
/// too (~8 ms, measured on 6.18); that one is the kernel's: `NFT_MSG_DESTROYTABLE` (which
/// would also spare the lookup) measured the same, and is not in kernels before 6.3.
pub(crate) fn remove(family: Family, name: &str) -> Result<bool> {
    remove_each(&[family], name)
}

/// [`remove`] of the tables `name` of each of `families`, in turn, on one socket; `Ok(true)`
/// when any was there.
pub(crate) fn remove_each(families: &[Family], name: &str) -> Result<bool> {
    let mut sock = open()?;
    let mut removed = false;
    for &family in families {
        if table_flags(&mut sock, family, name)?.is_none() {
            continue;
        }
        match commit(&mut sock, &render::delete_table(family, name)) {
            Ok(()) => removed = true,
            // Deleted by someone else since the lookup.
            Err(Error::Transaction { source, .. }) if source.raw_os_error() == Some(libc::ENOENT) => {}
            Err(e) => return Err(e),
        }
    }
    Ok(removed)
}

/// What the kernel will hold after `program(table)`, read from the very messages ADD sends.
///
/// A rule's view is taken from the typed expressions its bytes are written from (reading our
/// own bytes back through the crate's attribute parsers was two fifths of a CHECK):
/// `every_batch_parses_back_from_its_bytes_to_the_same_view` holds the two equal.
pub fn expected_view(table: &Table) -> TableView {
    let b = render::table_batch(table, Existing::Refuse);
    let (rules, others): (Vec<_>, Vec<_>) = b.messages.iter().map(|(p, _)| p).partition(|p| p.rule().is_some());
    let others: Vec<NfTablesMessage> = others.into_iter().map(render::Part::message).collect();
    let mut view = TableView::from_messages(&table.name, &others);
    for r in rules.into_iter().filter_map(render::Part::rule) {
        view.append_rule(r.chain().to_string(), r.view());
    }
    view
}

/// The flags of table `name` (e.g. dormant), or `None` when there is no such table.
fn table_flags(sock: &mut Socket, family: Family, name: &str) -> Result<Option<u32>> {
    let request = NfTablesMessage::GetTable(TableMessage { attributes: vec![] });
    let tables = dump(sock, family, request, name, "dump tables")?;
    Ok(tables.iter().find_map(|m| match m {
        NfTablesMessage::NewTable(t)
            if t.attributes.iter().any(|a| matches!(a, TableAttribute::Name(n) if n == name)) =>
        {
            Some(
                t.attributes
                    .iter()
                    .find_map(|a| match a {
                        TableAttribute::Flags(f) => Some(f.bits()),
                        _ => None,
                    })
                    .unwrap_or(0),
            )
        }
        _ => None,
    }))
}

/// Whether the current netns holds table `name` of `family` (one dump of the tables).
pub fn table_exists(family: Family, name: &str) -> Result<bool> {
    Ok(table_flags(&mut *open()?, family, name)?.is_some())
}

/// What the kernel holds of table `name` in the current netns, or `None` if it has no such
/// table.
pub fn kernel_view(family: Family, name: &str) -> Result<Option<TableView>> {
    let mut sock = open()?;
    let Some(flags) = table_flags(&mut sock, family, name)? else {
        return Ok(None);
    };
    let mut messages = dump(&mut sock, family, set_request(name), name, "dump sets")?;
    let set_names: Vec<String> = TableView::from_messages(name, &messages).sets.into_iter().map(|s| s.name).collect();
    for set in &set_names {
        messages.extend(dump_elements(&mut sock, family, name, set)?);
    }
    messages.extend(dump(&mut sock, family, obj_request(name), name, "dump counters")?);
    messages.extend(dump(
        &mut sock,
        family,
        NfTablesMessage::GetChain(netlink_packet_netfilter::nftables::ChainMessage { attributes: vec![] }),
        name,
        "dump chains",
    )?);
    messages.extend(dump(
        &mut sock,
        family,
        NfTablesMessage::GetRule(RuleMessage { attributes: vec![RuleAttribute::Table(name.to_string())] }),
        name,
        "dump rules",
    )?);
    let mut view = TableView::from_messages(name, &messages);
    view.flags = flags;
    Ok(Some(view))
}

#[cfg(test)]
mod tests;
