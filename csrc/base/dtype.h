/* Element types and reduction operators: the codes the stream-ordered
 * groups (sg/sgroup.h) and their devices' kernels (sgdev/) agree on. */
#ifndef UCCL_DTYPE_H
#define UCCL_DTYPE_H

#include <stddef.h>

enum {
    UCCL_DT_F32, UCCL_DT_F64, UCCL_DT_F16, UCCL_DT_BF16, UCCL_DT_I8, UCCL_DT_U8,
    UCCL_DT_I16, UCCL_DT_I32, UCCL_DT_I64, UCCL_DT_BOOL, UCCL_DT_COUNT
};
enum {
    UCCL_RED_SUM, UCCL_RED_PROD, UCCL_RED_MIN, UCCL_RED_MAX, UCCL_RED_BAND, UCCL_RED_BOR,
    UCCL_RED_BXOR, UCCL_RED_AVG, UCCL_RED_COUNT
};
size_t uccl_dtype_size(int dtype); /* 0 for an unknown type */
/* Their names in messages ("float32", "SUM"; "?" for an unknown code). */
const char *uccl_dtype_name(int dtype);
const char *uccl_red_name(int op);

#endif
