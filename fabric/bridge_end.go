package fabric

// BridgeEnd is the bridge's end of an application's stream, whatever
// carries it: a *BridgeStream (shared memory, an application on this host)
// or a *RemoteBridge (GENEVE, an application on another node). The bridge
// delivers into it without ever waiting and drains it through an
// EventQueue, the same way for both, so a packet is copied once on its
// way through the bridge whichever transport the application uses.
type BridgeEnd interface {
	// SendMeta queues packets for the application without waiting; what
	// does not fit (the ring is full, the peer has no credit left) is
	// dropped and counted. Metadata words are for transports that carry
	// them (meta may be nil). It reports how many went, and an error only
	// once the stream is dead.
	SendMeta(pkts [][]byte, meta []uint32) (int, error)
	// TryRecv takes up to len(bufs) of the application's packets without
	// waiting (see Link.Recv for the buffer contract).
	TryRecv(bufs [][]byte) (int, error)
	// TryRecvMeta is TryRecv returning each packet's metadata word into
	// meta (nil, or as long as bufs): the application's marks (MarkMask)
	// on either transport.
	TryRecvMeta(bufs [][]byte, meta []uint32) (int, error)
	// MaxPayload is the largest packet either direction carries.
	MaxPayload() int
	Health() Health
	Tick()
	Err() error
	Close() error
	queued
}

// queued is what an EventQueue needs of an end it gathers.
type queued interface {
	wakeFd() int      // signalled when data arrives for an armed consumer
	dataReady() bool  // packets, or a state the caller learns by receiving
	armFlag() *uint32 // the consumer's tripwire
	gone() bool       // to be dropped by the queue
	cond() *condition
	tenant() *tenancy
	release() // frees what Close left to the queue
}

var (
	_ BridgeEnd = (*BridgeStream)(nil)
	_ BridgeEnd = (*RemoteBridge)(nil)
)

func (s *BridgeStream) wakeFd() int      { return s.fds[fdTxData] }
func (s *BridgeStream) dataReady() bool  { return s.rr.ready() }
func (s *BridgeStream) armFlag() *uint32 { return s.recv.v.consArmed }
func (s *BridgeStream) cond() *condition { return &s.condition }
func (s *BridgeStream) tenant() *tenancy { return &s.tenancy }

// gone: closed, or broken by its owner's own call (which therefore
// already saw the error).
func (s *BridgeStream) gone() bool { return s.ended() }
