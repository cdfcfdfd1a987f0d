package nft

import (
	"encoding/binary"
	"fmt"
	"strings"
	"syscall"

	"golang.org/x/sys/unix"

	"github.com/fabricbridge/fabricbridge/classifier"
)

// Flow elements are added and deleted over netfilter's netlink socket, not
// through the nft binary: nft spends about 11 µs of user time parsing and
// evaluating each element of a script (a 100,000-flow release took 1.4 s
// in nft itself, 0.3 s in the kernel), where encoding one here costs tens
// of nanoseconds. One batch of messages is one nftables transaction, as a
// script is. Everything else (the table, its chains and rules, listener
// elements) still goes through nft, in the same queue, so changes keep
// their order.

// elemConn is a NETLINK_NETFILTER socket, bound to the network namespace
// of the thread that opened it, that changes set elements.
type elemConn struct {
	fd  int
	seq uint32
	buf []byte // the batch being built, reused
	rx  []byte
}

// elemSndBuf is the send buffer asked for: a batch is one datagram, and a
// datagram larger than the buffer is refused. 32 MiB holds about a
// million IPv4 flow elements.
const elemSndBuf = 32 << 20

func openElemConn() (*elemConn, error) {
	fd, err := unix.Socket(unix.AF_NETLINK, unix.SOCK_RAW|unix.SOCK_CLOEXEC, unix.NETLINK_NETFILTER)
	if err != nil {
		return nil, fmt.Errorf("netfilter netlink socket: %w", err)
	}
	if err := unix.Bind(fd, &unix.SockaddrNetlink{Family: unix.AF_NETLINK}); err != nil {
		unix.Close(fd)
		return nil, fmt.Errorf("netfilter netlink socket: %w", err)
	}
	if unix.SetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_SNDBUFFORCE, elemSndBuf) != nil {
		unix.SetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_SNDBUF, elemSndBuf)
	}
	// Errors without a copy of the request (which may be 64 KiB each),
	// with the kernel's reason in words.
	unix.SetsockoptInt(fd, unix.SOL_NETLINK, unix.NETLINK_CAP_ACK, 1)
	unix.SetsockoptInt(fd, unix.SOL_NETLINK, unix.NETLINK_EXT_ACK, 1)
	tv := unix.NsecToTimeval(int64(elemAnswerWait))
	unix.SetsockoptTimeval(fd, unix.SOL_SOCKET, unix.SO_RCVTIMEO, &tv)
	return &elemConn{fd: fd, rx: make([]byte, 1<<16)}, nil
}

// elemAnswerWait bounds the wait for the kernel's answer to a batch; the
// kernel answers before sendmsg returns, so it is a guard, not a delay.
const elemAnswerWait = 10e9 // 10 s

func (c *elemConn) close() {
	if c != nil {
		unix.Close(c.fd)
	}
}

// elemChange adds (add) or deletes flows' elements.
type elemChange struct {
	flows []classifier.FlowKey
	add   bool
}

// maxElemsAttr bounds the elements attribute of one message: an attribute's
// length is 16 bits.
const maxElemsAttr = 60 << 10

// apply runs changes, in order, as one transaction on table's sets.
func (c *elemConn) apply(table string, changes []elemChange) error {
	c.buf = c.buf[:0]
	first := c.seq + 1
	c.endMessage(c.message(unix.NFNL_MSG_BATCH_BEGIN, unix.NLM_F_REQUEST, unix.AF_UNSPEC, unix.NFNL_SUBSYS_NFTABLES))
	var (
		open     = -1 // offset of the open message, -1: none
		nest     int  // offset of its elements attribute
		openSet  string
		openAdd  bool
		lastElem uint32 // seq of the last element message
	)
	closeMsg := func() {
		if open >= 0 {
			c.endAttr(nest)
			c.endMessage(open)
			open = -1
		}
	}
	for _, ch := range changes {
		for _, k := range ch.flows {
			set := "flows4"
			if k.Family == 6 {
				set = "flows6"
			}
			if open >= 0 && (set != openSet || ch.add != openAdd || len(c.buf)-nest > maxElemsAttr) {
				closeMsg()
			}
			if open < 0 {
				typ, flags := uint16(unix.NFT_MSG_DELSETELEM), uint16(unix.NLM_F_REQUEST|unix.NLM_F_ACK)
				if ch.add {
					typ, flags = unix.NFT_MSG_NEWSETELEM, flags|unix.NLM_F_CREATE
				}
				open = c.message(unix.NFNL_SUBSYS_NFTABLES<<8|typ, flags, unix.NFPROTO_NETDEV, 0)
				lastElem = c.seq
				c.attrString(unix.NFTA_SET_ELEM_LIST_TABLE, table)
				c.attrString(unix.NFTA_SET_ELEM_LIST_SET, set)
				nest = c.beginAttr(unix.NFTA_SET_ELEM_LIST_ELEMENTS | unix.NLA_F_NESTED)
				openSet, openAdd = set, ch.add
			}
			elem := c.beginAttr(unix.NFTA_LIST_ELEM | unix.NLA_F_NESTED)
			key := c.beginAttr(unix.NFTA_SET_ELEM_KEY | unix.NLA_F_NESTED)
			val := c.beginAttr(unix.NFTA_DATA_VALUE)
			c.buf = appendFlowKey(c.buf, k)
			c.endAttr(val)
			c.endAttr(key)
			c.endAttr(elem)
		}
	}
	closeMsg()
	if lastElem == 0 {
		return nil
	}
	c.endMessage(c.message(unix.NFNL_MSG_BATCH_END, unix.NLM_F_REQUEST, unix.AF_UNSPEC, unix.NFNL_SUBSYS_NFTABLES))
	if err := unix.Sendto(c.fd, c.buf, 0, &unix.SockaddrNetlink{Family: unix.AF_NETLINK}); err != nil {
		return fmt.Errorf("netlink: send %d bytes: %w", len(c.buf), err)
	}
	return c.answer(first, lastElem)
}

// answer reads the kernel's answers to the batch of sequence numbers
// first..last, until the last element message's acknowledgement; the
// first error of the batch (the whole transaction failed) is returned.
func (c *elemConn) answer(first, last uint32) error {
	var failed error
	for {
		n, _, err := unix.Recvfrom(c.fd, c.rx, 0)
		if err == unix.EINTR {
			continue
		}
		if err != nil {
			if failed != nil {
				return failed
			}
			return fmt.Errorf("netlink: no answer to the batch: %w", err)
		}
		msgs, err := syscall.ParseNetlinkMessage(c.rx[:n])
		if err != nil {
			return fmt.Errorf("netlink: %w", err)
		}
		for _, m := range msgs {
			if m.Header.Seq < first || m.Header.Seq > last || m.Header.Type != unix.NLMSG_ERROR || len(m.Data) < 4 {
				continue // a late answer to an earlier batch
			}
			if errno := -int32(binary.NativeEndian.Uint32(m.Data)); errno != 0 && failed == nil {
				failed = fmt.Errorf("netlink: %w%s", syscall.Errno(errno), extAckMessage(m))
			}
			if m.Header.Seq == last {
				return failed
			}
		}
	}
}

// extAckMessage is the kernel's explanation of an error, if it gave one.
func extAckMessage(m syscall.NetlinkMessage) string {
	if m.Header.Flags&unix.NLM_F_ACK_TLVS == 0 || len(m.Data) < 4+unix.SizeofNlMsghdr {
		return ""
	}
	// With NETLINK_CAP_ACK the error is followed by the request's header
	// only, then the attributes.
	b := m.Data[4+unix.SizeofNlMsghdr:]
	for len(b) >= 4 {
		l, typ := int(binary.NativeEndian.Uint16(b)), binary.NativeEndian.Uint16(b[2:])
		if l < 4 || l > len(b) {
			break
		}
		if typ == unix.NLMSGERR_ATTR_MSG {
			return ": " + strings.TrimRight(string(b[4:l]), "\x00")
		}
		b = b[(l+3)&^3:]
	}
	return ""
}

// appendFlowKey appends k as the flow sets' key: the fields of
// "inet_proto . addr . inet_service . addr . inet_service", each in network
// order and padded with zeros to 32 bits, as nftables concatenates them.
func appendFlowKey(b []byte, k classifier.FlowKey) []byte {
	addr := 16
	if k.Family == 4 {
		addr = 4
	}
	b = append(b, k.Proto, 0, 0, 0)
	b = append(b, k.Src[:addr]...)
	b = append(b, byte(k.SrcPort>>8), byte(k.SrcPort), 0, 0)
	b = append(b, k.Dst[:addr]...)
	return append(b, byte(k.DstPort>>8), byte(k.DstPort), 0, 0)
}

// message starts a netlink message with its nfgenmsg header and returns
// its offset; endMessage sets its length.
func (c *elemConn) message(typ, flags uint16, family uint8, resID uint16) int {
	c.seq++
	if c.seq == 0 {
		c.seq = 1
	}
	off := len(c.buf)
	c.buf = binary.NativeEndian.AppendUint32(c.buf, 0)
	c.buf = binary.NativeEndian.AppendUint16(c.buf, typ)
	c.buf = binary.NativeEndian.AppendUint16(c.buf, flags)
	c.buf = binary.NativeEndian.AppendUint32(c.buf, c.seq)
	c.buf = binary.NativeEndian.AppendUint32(c.buf, 0)
	c.buf = append(c.buf, family, unix.NFNETLINK_V0)
	c.buf = binary.BigEndian.AppendUint16(c.buf, resID)
	return off
}

func (c *elemConn) endMessage(off int) {
	c.pad()
	binary.NativeEndian.PutUint32(c.buf[off:], uint32(len(c.buf)-off))
}

func (c *elemConn) beginAttr(typ uint16) int {
	off := len(c.buf)
	c.buf = binary.NativeEndian.AppendUint16(c.buf, 0)
	c.buf = binary.NativeEndian.AppendUint16(c.buf, typ)
	return off
}

func (c *elemConn) endAttr(off int) {
	binary.NativeEndian.PutUint16(c.buf[off:], uint16(len(c.buf)-off))
	c.pad()
}

func (c *elemConn) attrString(typ uint16, s string) {
	off := c.beginAttr(typ)
	c.buf = append(c.buf, s...)
	c.buf = append(c.buf, 0)
	c.endAttr(off)
}

func (c *elemConn) pad() {
	for len(c.buf)%4 != 0 {
		c.buf = append(c.buf, 0)
	}
}
