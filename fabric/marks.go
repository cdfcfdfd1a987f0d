package fabric

// Marks are the high bits of a packet's metadata word in a stream (the low
// 16 bits carry the rule id on the bridge's side). They implement the
// previous-owner "second chance" of a listener shared by several instances
// (classifier.Spread):
//
//   - the bridge delivers a packet steered by a slot that has a previous
//     owner with MarkMayReturn;
//   - an instance that gets such a packet for a TCP connection it does not
//     know, and that does not open one (no SYN), sends it back unchanged,
//     as received, with MarkNotMine instead of answering it with a reset;
//   - the bridge checks that the packet is one the sender's slot steered to
//     it, and hands it from the current owner to the previous one (again
//     with MarkMayReturn), or from the previous owner back to the current
//     one without a mark, which then must answer it (a SYN cookie's ACK, or
//     a reset).
//
// So a packet makes at most three trips, and only packets of connections
// whose slot changed hands make more than one.
const (
	MarkMayReturn uint32 = 1 << 31 // bridge → application
	MarkNotMine   uint32 = 1 << 30 // application → bridge
	// MarkMask covers every mark; the rest of the word is the rule id.
	MarkMask uint32 = 0xffff0000
)
